/* Virtual memory management: reserve, create, map, access, release,
 * export and import, with the real driver's rules.
 *
 * Error codes: argument errors are CUDA_ERROR_INVALID_VALUE, bad device
 * ordinals CUDA_ERROR_INVALID_DEVICE, as the driver documents them. A handle
 * that is not live (never created, or released) is CUDA_ERROR_INVALID_VALUE:
 * generic allocation handles are plain integers the driver validates as
 * arguments. */
#include "sim.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define HANDLE_TYPES_KNOWN                                                        \
    ((uint64_t)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_WIN32 | \
     CU_MEM_HANDLE_TYPE_WIN32_KMT | CU_MEM_HANDLE_TYPE_FABRIC)

/* ---- tables (sim.mu held) --------------------------------------------- */

struct sim_obj *sim_obj_find(CUmemGenericAllocationHandle h)
{
    for (int i = 0; i < SIM_MAX_OBJS; i++)
        if (sim.objs[i].used && sim.objs[i].handle == h && sim.objs[i].handle_refs > 0)
            return &sim.objs[i];
    return NULL;
}

struct sim_map *sim_map_find(uintptr_t va)
{
    for (int i = 0; i < SIM_MAX_MAPS; i++) {
        struct sim_map *m = &sim.maps[i];

        if (m->used && va >= m->va && va - m->va < m->size)
            return m;
    }
    return NULL;
}

static struct sim_resv *resv_find(uintptr_t va, size_t size)
{
    for (int i = 0; i < SIM_MAX_RESV; i++) {
        struct sim_resv *r = &sim.resv[i];

        if (r->used && va >= r->base && va - r->base < r->size && size <= r->size - (va - r->base))
            return r;
    }
    return NULL;
}

int sim_is_device_ptr(uintptr_t p)
{
    return resv_find(p, 1) != NULL;
}

static struct sim_map *map_alloc(void)
{
    for (int i = 0; i < SIM_MAX_MAPS; i++)
        if (!sim.maps[i].used)
            return &sim.maps[i];
    return NULL;
}

/* The physical memory is gone once nothing in this process refers to it:
 * no handle and no mapping. Other processes keep their own references (the
 * kernel keeps the memfd alive for them). */
void sim_obj_unref(struct sim_obj *o)
{
    if (o->handle_refs > 0 || o->map_count > 0)
        return;
    if (o->kind == SIM_KIND_ALLOC && !o->imported && !o->released)
        sim_acct_add(o->props.loc_id, -(long long)o->size);
    if (o->kind == SIM_KIND_MULTICAST && o->meta)
        sim_mc_drop_binds(o);
    if (o->saved)
        munmap(o->saved, o->size);
    free(o->pack);
    /* A checkpointed process has already dropped its reference. */
    if (o->meta)
        munmap(o->meta, SIM_META_SIZE);
    if (o->fd >= 0)
        close(o->fd);
    memset(o, 0, sizeof(*o));
}

/* The memfd of a physical allocation, its properties in the metadata page
 * for whoever imports it. */
CUresult sim_alloc_memfd(uint64_t size, const struct sim_props *p, int *fd,
                         struct sim_meta **meta_out)
{
    struct sim_meta *meta;
    CUresult r = sim_memfd_new("cuinterpose-sim-alloc", size, fd, &meta);

    if (r != CUDA_SUCCESS)
        return r;
    meta->kind = SIM_KIND_ALLOC;
    meta->props = *p;
    *meta_out = meta;
    return CUDA_SUCCESS;
}

CUresult sim_obj_new(int kind, int fd, struct sim_meta *meta, uint64_t size, struct sim_obj **out)
{
    for (int i = 0; i < SIM_MAX_OBJS; i++) {
        struct sim_obj *o = &sim.objs[i];

        if (o->used)
            continue;
        memset(o, 0, sizeof(*o));
        o->used = 1;
        o->kind = kind;
        o->fd = fd;
        o->meta = meta;
        o->size = size;
        o->handle_refs = 1;
        o->props = meta->props;
        o->handle = sim.next_handle;
        /* Unique beyond this process: an IPC open keeps its creator's. */
        o->id = ((unsigned long long)getpid() << 32) | ++sim.next_obj_id;
        sim.next_handle += 0x10;
        *out = o;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Host protection is the union of what the devices may do: the CPU stands
 * in for every device. Copies check the calling device's own access. */
CUresult sim_map_apply_prot(struct sim_map *m)
{
    int prot = PROT_NONE;

    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        if (m->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            prot |= PROT_READ | PROT_WRITE;
        else if (m->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READ)
            prot |= PROT_READ;
    }
    if (mprotect((void *)m->va, m->size, prot) != 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    return CUDA_SUCCESS;
}

int sim_legacy_span(const struct sim_map *m, uintptr_t p, struct sim_span *s)
{
    const struct sim_obj *o = &sim.objs[m->obj];
    uintptr_t base = m->va - m->offset;

    if (p < m->va || p - m->va >= m->size)
        return 0;
    if (o->pack) {
        unsigned first = o->pack->owner[(p - base) / SIM_PACK_UNIT];

        if (first == 0 || p - (base + (first - 1) * SIM_PACK_UNIT) >= o->pack->sub[first - 1].bytes)
            return 0;
        s->base = base + (first - 1) * SIM_PACK_UNIT;
        s->bytes = o->pack->sub[first - 1].bytes;
        s->id = o->pack->sub[first - 1].id;
        return 1;
    }
    /* An IPC open of a packed request maps its chunk, names its part only. */
    base += o->sub_off;
    if (p < base || p - base >= o->bytes)
        return 0;
    s->base = base;
    s->bytes = o->bytes;
    s->id = o->id;
    return 1;
}

/* Where the memory `p` lies in ends (p itself when `p` is in none): memory a
 * pointer names ends where its allocation ends, not where its granule does. */
static uintptr_t map_end(const struct sim_map *m, uintptr_t p)
{
    const struct sim_obj *o = &sim.objs[m->obj];
    struct sim_span sp;

    if (!o->legacy || (!o->bytes && !o->pack))
        return m->va + m->size;
    if (!sim_legacy_span(m, p, &sp))
        return p;
    return sp.base + sp.bytes < m->va + m->size ? sp.base + sp.bytes : m->va + m->size;
}

/* `copy`: the driver copies cuMemAlloc-like memory from any device's
 * context (staged when the device has no peer access); everything else,
 * and VMM memory always, needs the calling device's own access. */
static CUresult range_check(uintptr_t p, size_t n, int dev, int want_write, int copy)
{
    uintptr_t cur = p, end;

    if (n == 0)
        return CUDA_SUCCESS;
    if (p + n < p)
        return CUDA_ERROR_INVALID_VALUE;
    end = p + n;
    while (cur < end) {
        struct sim_map *m = sim_map_find(cur);
        unsigned acc;

        if (!m || m->taken || cur >= map_end(m, cur))
            return CUDA_ERROR_INVALID_VALUE;
        acc = m->access[dev];
        if (copy && sim.objs[m->obj].legacy)
            acc = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if (acc == CU_MEM_ACCESS_FLAGS_PROT_NONE)
            return CUDA_ERROR_INVALID_VALUE;
        if (want_write && acc != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
        cur = map_end(m, cur);
    }
    return CUDA_SUCCESS;
}

/* [p, p+n) must be mapped throughout, with the access the calling device
 * needs. A copy from or to anything else is refused with
 * CUDA_ERROR_INVALID_VALUE before any byte moves: never a fault. */
CUresult sim_range_check(uintptr_t p, size_t n, int dev, int want_write)
{
    return range_check(p, n, dev, want_write, 0);
}

CUresult sim_copy_range_check(uintptr_t p, size_t n, int dev, int want_write)
{
    return range_check(p, n, dev, want_write, 1);
}

/* ---- granularity and properties --------------------------------------- */

static CUresult prop_check(const CUmemAllocationProp *prop)
{
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(prop->location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    if ((uint64_t)prop->requestedHandleTypes & ~HANDLE_TYPES_KNOWN)
        return CUDA_ERROR_INVALID_VALUE;
    /* Windows handle types do not exist on Linux. */
    if (prop->requestedHandleTypes & (CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

static CUresult granularity(size_t *g, const CUmemAllocationProp *prop,
                            CUmemAllocationGranularity_flags option)
{
    CUresult r;

    if (!g)
        return CUDA_ERROR_INVALID_VALUE;
    r = prop_check(prop);
    if (r != CUDA_SUCCESS)
        return r;
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
        option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return CUDA_ERROR_INVALID_VALUE;
    *g = SIM_GRANULARITY;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity_out,
                                               const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option)
{
    SIM_API(granularity(granularity_out, prop, option));
}

/* ---- reserve ---------------------------------------------------------- */

static CUresult reserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                        unsigned long long flags)
{
    struct sim_resv *slot = NULL;
    uint8_t *raw = MAP_FAILED;
    uintptr_t base;
    size_t span;

    if (!ptr || size == 0 || !sim_is_aligned(size, SIM_GRANULARITY) || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (align == 0)
        align = SIM_GRANULARITY;
    if ((align & (align - 1)) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (align < SIM_GRANULARITY)
        align = SIM_GRANULARITY;
    sim_lock();
    for (int i = 0; i < SIM_MAX_RESV && !slot; i++)
        if (!sim.resv[i].used)
            slot = &sim.resv[i];
    if (!slot)
        goto oom;
    /* The address is a hint, as on the real driver: honoured when free. */
    if (addr && sim_is_aligned(addr, align))
        raw = mmap((void *)addr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    /* Kernels before 4.17 take the flag as a plain hint and may place the
     * range elsewhere, unaligned: then reserve as if there were no hint. */
    if (raw != MAP_FAILED && (uintptr_t)raw != addr) {
        munmap(raw, size);
        raw = MAP_FAILED;
    }
    if (raw != MAP_FAILED) {
        base = (uintptr_t)raw;
    } else {
        span = size + align;
        raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (raw == MAP_FAILED)
            goto oom;
        base = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
        /* Trim to the aligned range so that free is exact. */
        if (base > (uintptr_t)raw)
            munmap(raw, base - (uintptr_t)raw);
        if ((uintptr_t)raw + span > base + size)
            munmap((void *)(base + size), (uintptr_t)raw + span - (base + size));
    }
    slot->used = 1;
    slot->base = base;
    slot->size = size;
    sim_unlock();
    *ptr = (CUdeviceptr)base;
    return CUDA_SUCCESS;
oom:
    sim_unlock();
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                     CUdeviceptr addr, unsigned long long flags)
{
    SIM_API(reserve(ptr, size, alignment, addr, flags));
}

static CUresult address_free(CUdeviceptr ptr, size_t size)
{
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    sim_lock();
    for (int i = 0; i < SIM_MAX_RESV; i++) {
        struct sim_resv *v = &sim.resv[i];

        if (!v->used || v->base != ptr || v->size != size)
            continue;
        /* Mapped ranges must be unmapped first. */
        for (int j = 0; j < SIM_MAX_MAPS; j++)
            if (sim.maps[j].used && sim.maps[j].va >= v->base && sim.maps[j].va - v->base < v->size)
                goto out;
        if (munmap((void *)v->base, v->size) != 0) {
            r = CUDA_ERROR_OPERATING_SYSTEM;
            goto out;
        }
        memset(v, 0, sizeof(*v));
        r = CUDA_SUCCESS;
        break;
    }
out:
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    SIM_API(address_free(ptr, size));
}

/* ---- create / release ------------------------------------------------- */

static CUresult create_alloc(struct sim_obj **out, size_t size, const CUmemAllocationProp *prop)
{
    struct sim_meta *meta = NULL;
    struct sim_obj *o;
    int fd = -1;
    CUresult r;
    const struct sim_props p = {
        .alloc_type = prop->type,
        .loc_type = prop->location.type,
        .loc_id = prop->location.id,
        .handle_types = (uint64_t)prop->requestedHandleTypes,
        .compression = prop->allocFlags.compressionType,
        .rdma = prop->allocFlags.gpuDirectRDMACapable,
        .usage = prop->allocFlags.usage,
    };

    if (sim_acct_used(prop->location.id) + size > sim.mem_total)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r = sim_alloc_memfd(size, &p, &fd, &meta);
    if (r != CUDA_SUCCESS)
        return r;
    r = sim_obj_new(SIM_KIND_ALLOC, fd, meta, size, &o);
    if (r != CUDA_SUCCESS)
        goto fail;
    meta->alloc_id = o->id;
    sim_acct_add(prop->location.id, (long long)size);
    *out = o;
    return CUDA_SUCCESS;
fail:
    munmap(meta, SIM_META_SIZE);
    close(fd);
    return r;
}

static CUresult mem_create(CUmemGenericAllocationHandle *h, size_t size,
                           const CUmemAllocationProp *prop, unsigned long long flags)
{
    struct sim_obj *o;
    CUresult r;

    if (!h || size == 0 || !sim_is_aligned(size, SIM_GRANULARITY) || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    r = prop_check(prop);
    if (r != CUDA_SUCCESS)
        return r;
    sim_lock();
    r = create_alloc(&o, size, prop);
    if (r == CUDA_SUCCESS)
        *h = o->handle;
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                             const CUmemAllocationProp *prop, unsigned long long flags)
{
    SIM_API(mem_create(handle, size, prop, flags));
}

static CUresult mem_release(CUmemGenericAllocationHandle h)
{
    struct sim_obj *o;

    sim_lock();
    o = sim_obj_find(h);
    if (o) {
        o->handle_refs--;
        sim_obj_unref(o);
    }
    sim_unlock();
    return o ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle)
{
    SIM_API(mem_release(handle));
}

static CUresult retain(CUmemGenericAllocationHandle *h, void *addr)
{
    struct sim_map *m;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    m = sim_map_find((uintptr_t)addr);
    if (m && !sim.objs[m->obj].legacy) {
        /* Same value as the creating handle: the driver counts references
         * on one handle rather than minting a new one. */
        sim.objs[m->obj].handle_refs++;
        *h = sim.objs[m->obj].handle;
        r = CUDA_SUCCESS;
    }
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    SIM_API(retain(handle, addr));
}

static CUresult get_props(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    struct sim_obj *o;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    o = sim_obj_find(h);
    if (o && o->kind == SIM_KIND_ALLOC) {
        memset(prop, 0, sizeof(*prop));
        prop->type = (CUmemAllocationType)o->props.alloc_type;
        prop->location.type = (CUmemLocationType)o->props.loc_type;
        prop->location.id = o->props.loc_id;
        prop->requestedHandleTypes = (CUmemAllocationHandleType)o->props.handle_types;
        prop->allocFlags.compressionType = o->props.compression;
        prop->allocFlags.gpuDirectRDMACapable = o->props.rdma;
        prop->allocFlags.usage = o->props.usage;
        r = CUDA_SUCCESS;
    }
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                        CUmemGenericAllocationHandle handle)
{
    SIM_API(get_props(prop, handle));
}

/* ---- map / unmap ------------------------------------------------------ */

static int overlaps_mapping(uintptr_t va, size_t size)
{
    for (int i = 0; i < SIM_MAX_MAPS; i++) {
        struct sim_map *m = &sim.maps[i];

        if (m->used && va < m->va + m->size && m->va < va + size)
            return 1;
    }
    return 0;
}

/* sim.mu held. */
static CUresult map_locked(uintptr_t va, size_t size, size_t offset, struct sim_obj *o)
{
    struct sim_map *m;
    void *p;

    if (offset > o->size || size > o->size - offset)
        return CUDA_ERROR_INVALID_VALUE;
    if (!resv_find(va, size) || overlaps_mapping(va, size))
        return CUDA_ERROR_INVALID_VALUE;
    m = map_alloc();
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* Without cuMemSetAccess the range stays inaccessible, as on a GPU. */
    p = mmap((void *)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, o->fd, (off_t)offset);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    memset(m, 0, sizeof(*m));
    m->used = 1;
    m->group = ++sim.next_map_group;
    m->va = va;
    m->size = size;
    m->obj = (int)(o - sim.objs);
    m->offset = offset;
    o->map_count++;
    return CUDA_SUCCESS;
}

static CUresult mem_map(CUdeviceptr ptr, size_t size, size_t offset,
                        CUmemGenericAllocationHandle h, unsigned long long flags)
{
    struct sim_obj *o;
    CUresult r;

    if (size == 0 || flags != 0 || !sim_is_aligned(ptr, SIM_GRANULARITY))
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    o = sim_obj_find(h);
    if (!o) {
        sim_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* Offsets and sizes the allocation cannot provide: the real driver
     * answers NOT_SUPPORTED here (specs/records). */
    if (!sim_is_aligned(size, SIM_GRANULARITY) || !sim_is_aligned(offset, SIM_GRANULARITY) ||
        offset >= o->size || size > o->size - offset) {
        sim_unlock();
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    /* The real driver maps only a whole allocation, even at aligned partial
     * offsets and sizes (seen on the H200: map_partial_* in specs/records). */
    if (o->kind != SIM_KIND_MULTICAST && (offset != 0 || size != o->size)) {
        sim_unlock();
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (o->kind == SIM_KIND_MULTICAST) {
        /* Mapping a multicast object waits for the whole team; the wait
         * must not hold the tables (another thread may be adding a device).
         * A temporary reference keeps the object alive meanwhile. */
        o->handle_refs++;
        sim_unlock();
        r = sim_mc_wait_complete(o);
        sim_lock();
        o->handle_refs--;
        if (r == CUDA_SUCCESS && o->handle_refs <= 0)
            r = CUDA_ERROR_INVALID_VALUE;
        if (r != CUDA_SUCCESS) {
            sim_obj_unref(o);
            sim_unlock();
            return r;
        }
    }
    r = map_locked((uintptr_t)ptr, size, offset, o);
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    SIM_API(mem_map(ptr, size, offset, handle, flags));
}

/* The real driver unmaps whole cuMemMap ranges only: a range that cuts
 * through one is refused, while parts with nothing mapped are ignored
 * (specs/records: unmap of an unmapped range succeeds). A cuMemMap range
 * split by cuMemSetAccess is still one group. */
static int whole_groups(uintptr_t va, size_t size)
{
    for (int i = 0; i < SIM_MAX_MAPS; i++) {
        const struct sim_map *m = &sim.maps[i];

        if (!m->used || !(m->va < va + size && va < m->va + m->size))
            continue;
        for (int j = 0; j < SIM_MAX_MAPS; j++) {
            const struct sim_map *n = &sim.maps[j];

            if (n->used && n->group == m->group && (n->va < va || n->va + n->size > va + size))
                return 0;
        }
    }
    return 1;
}

static void unmap_one(struct sim_map *m)
{
    struct sim_obj *o = &sim.objs[m->obj];

    /* Back to reserved, inaccessible address space. Replacing a mapping of
     * our own reservation can only fail for lack of kernel memory; the
     * pages would then stay mapped, so say so rather than stay silent. */
    if (mmap((void *)m->va, m->size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED)
        fprintf(stderr, "cuinterpose-sim: unmap of %#lx failed: %s\n", (unsigned long)m->va,
                strerror(errno));
    memset(m, 0, sizeof(*m));
    o->map_count--;
    sim_obj_unref(o);
}

/* sim.mu held. */
static CUresult unmap_locked(uintptr_t va, size_t size)
{
    if (!whole_groups(va, size))
        return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < SIM_MAX_MAPS; i++) {
        struct sim_map *m = &sim.maps[i];

        if (m->used && m->va >= va && m->va + m->size <= va + size)
            unmap_one(m);
    }
    return CUDA_SUCCESS;
}

static CUresult mem_unmap(CUdeviceptr ptr, size_t size)
{
    CUresult r;

    if (size == 0 || !sim_is_aligned(ptr, SIM_GRANULARITY) || !sim_is_aligned(size, SIM_GRANULARITY))
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_fault_due(&sim.fail_unmap);
    if (r != CUDA_SUCCESS)
        return r;
    sim_lock();
    r = unmap_locked((uintptr_t)ptr, size);
    sim_unlock();
    return r;
}

int cuinterposeSimFailUnmap(unsigned skip, CUresult result)
{
    sim_fault_arm(&sim.fail_unmap, skip, result);
    return 0;
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    SIM_API(mem_unmap(ptr, size));
}

/* ---- access ----------------------------------------------------------- */

/* Split the mapping holding `at` so that a mapping starts there. */
static CUresult split_at(uintptr_t at)
{
    struct sim_map *m = sim_map_find(at), *n;

    if (!m || m->va == at)
        return CUDA_SUCCESS;
    n = map_alloc();
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *n = *m;
    n->va = at;
    n->size = m->va + m->size - at;
    n->offset = m->offset + (at - m->va);
    m->size = at - m->va;
    sim.objs[m->obj].map_count++;
    return CUDA_SUCCESS;
}

static int covered(uintptr_t va, size_t size)
{
    for (uintptr_t cur = va; cur < va + size;) {
        struct sim_map *m = sim_map_find(cur);

        if (!m)
            return 0;
        cur = m->va + m->size;
    }
    return 1;
}

static CUresult set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    uintptr_t va = (uintptr_t)ptr;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    if (!desc || count == 0 || size == 0 || !sim_is_aligned(va, SIM_GRANULARITY) ||
        !sim_is_aligned(size, SIM_GRANULARITY))
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
            return CUDA_ERROR_INVALID_VALUE;
        if (!sim_dev_valid(desc[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
    }
    sim_lock();
    if (!covered(va, size))
        goto out;
    r = split_at(va);
    if (r == CUDA_SUCCESS)
        r = split_at(va + size);
    for (uintptr_t cur = va; r == CUDA_SUCCESS && cur < va + size;) {
        struct sim_map *m = sim_map_find(cur);

        for (size_t i = 0; i < count; i++)
            m->access[desc[i].location.id] = (uint8_t)desc[i].flags;
        r = sim_map_apply_prot(m);
        cur = m->va + m->size;
    }
out:
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                size_t count)
{
    SIM_API(set_access(ptr, size, desc, count));
}

static CUresult get_access(unsigned long long *flags, const CUmemLocation *loc, CUdeviceptr ptr)
{
    struct sim_map *m;

    if (!flags || !loc)
        return CUDA_ERROR_INVALID_VALUE;
    /* A location that names no device is INVALID_DEVICE (specs/records). */
    if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE || !sim_dev_valid(loc->id))
        return CUDA_ERROR_INVALID_DEVICE;
    sim_lock();
    m = sim_map_find((uintptr_t)ptr);
    if (m)
        *flags = m->access[loc->id];
    sim_unlock();
    return m ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location,
                                CUdeviceptr ptr)
{
    SIM_API(get_access(flags, location, ptr));
}

/* ---- export / import -------------------------------------------------- */

static CUresult export_handle(void *out, CUmemGenericAllocationHandle h,
                              CUmemAllocationHandleType type, unsigned long long flags)
{
    struct sim_obj *o;
    CUresult r = CUDA_SUCCESS;
    int fd;

    if (!out || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    o = sim_obj_find(h);
    if (!o || !(o->props.handle_types & (uint64_t)type) || (type & (type - 1)) != 0) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        /* Fabric handles need an IMEX channel: not on this machine. */
        r = CUDA_ERROR_NOT_SUPPORTED;
        goto out;
    }
    fd = fcntl(o->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
        r = CUDA_ERROR_OPERATING_SYSTEM;
        goto out;
    }
    *(int *)out = fd;
out:
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle,
                                              CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType handleType,
                                              unsigned long long flags)
{
    SIM_API(export_handle(shareableHandle, handle, handleType, flags));
}

/* Read and check the metadata page of an FD someone handed us. */
static CUresult open_meta(int fd, uint64_t *size, struct sim_meta **meta_out)
{
    struct sim_meta *meta;
    struct stat st;

    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size <= SIM_META_SIZE)
        return CUDA_ERROR_UNKNOWN;
    *size = (uint64_t)st.st_size - SIM_META_SIZE;
    if (!sim_is_aligned(*size, SIM_GRANULARITY))
        return CUDA_ERROR_UNKNOWN;
    meta = mmap(NULL, SIM_META_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)*size);
    if (meta == MAP_FAILED)
        return CUDA_ERROR_UNKNOWN;
    if (meta->magic != SIM_META_MAGIC || meta->size != *size ||
        (meta->kind != SIM_KIND_ALLOC && meta->kind != SIM_KIND_MULTICAST)) {
        munmap(meta, SIM_META_SIZE);
        return CUDA_ERROR_UNKNOWN;
    }
    *meta_out = meta;
    return CUDA_SUCCESS;
}

/* Takes `fd` (closed on failure). sim.mu not held. */
CUresult sim_obj_import_fd(int fd, struct sim_obj **out)
{
    struct sim_meta *meta = NULL;
    struct sim_obj *o;
    uint64_t size;
    CUresult r;

    r = open_meta(fd, &size, &meta);
    if (r != CUDA_SUCCESS)
        goto fail;
    sim_lock();
    r = sim_obj_new((int)meta->kind, fd, meta, size, &o);
    if (r == CUDA_SUCCESS) {
        o->imported = 1;
        o->foreign = meta->creator_pid != (int32_t)getpid();
        *out = o;
    }
    sim_unlock();
    if (r != CUDA_SUCCESS)
        goto fail;
    return CUDA_SUCCESS;
fail:
    if (meta)
        munmap(meta, SIM_META_SIZE);
    close(fd);
    return r;
}

static CUresult import_handle(CUmemGenericAllocationHandle *h, void *os_handle,
                              CUmemAllocationHandleType type)
{
    struct sim_obj *o;
    int fd;
    CUresult r;

    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    if (type == CU_MEM_HANDLE_TYPE_FABRIC)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_INVALID_VALUE;
    /* The POSIX FD travels in the pointer-sized argument itself. A closed
     * FD or one that is no allocation is CUDA_ERROR_UNKNOWN on the real
     * driver (specs/records: bogus FD, /dev/null). */
    fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_UNKNOWN;
    r = sim_obj_import_fd(fd, &o);
    if (r == CUDA_SUCCESS)
        *h = o->handle; /* read under no lock: the value never changes */
    return r;
}

CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                void *osHandle,
                                                CUmemAllocationHandleType shHandleType)
{
    SIM_API(import_handle(handle, osHandle, shHandleType));
}

/* ---- memory a pointer names: fresh mappings ------------------------- */

/* Map all of `o` at a new VA (sim.mu not held). */
CUresult sim_map_fresh(struct sim_obj *o, uintptr_t *va_out)
{
    CUdeviceptr va = 0;
    CUresult r = reserve(&va, o->size, 0, 0, 0);

    if (r != CUDA_SUCCESS)
        return r;
    sim_lock();
    r = map_locked((uintptr_t)va, o->size, 0, o);
    sim_unlock();
    if (r != CUDA_SUCCESS) {
        address_free(va, o->size);
        return r;
    }
    *va_out = (uintptr_t)va;
    return CUDA_SUCCESS;
}

/* Undo sim_map_fresh: the mapping at `va` and its reservation go; the
 * object goes with its last reference (sim.mu not held). */
CUresult sim_unmap_fresh(uintptr_t va)
{
    struct sim_map *m;
    size_t size;

    sim_lock();
    m = sim_map_find(va);
    if (!m || m->va != va) {
        sim_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    size = m->size;
    sim.objs[m->obj].handle_refs = 0;
    unmap_one(m);
    sim_unlock();
    return address_free(va, size);
}

/* Which devices may access `o`'s mapping `m` (sim.mu held): cuMemAlloc
 * memory its own device, and every device whose context enabled peer
 * access to the allocating one (device.c); pool memory its device. */
static void legacy_access(struct sim_map *m, const struct sim_obj *o)
{
    for (int d = 0; d < SIM_MAX_DEVICES; d++) {
        int ok = d == o->props.loc_id;

        if (!ok && o->origin == SIM_FROM_ALLOC && o->ctx)
            ok = d < sim.ndev && sim_dev_sees_ctx(d, o->ctx);
        m->access[d] = ok ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
    }
}

void sim_legacy_access_refresh(void)
{
    for (int i = 0; i < SIM_MAX_MAPS; i++) {
        struct sim_map *m = &sim.maps[i];

        if (m->used && !m->taken && sim.objs[m->obj].origin == SIM_FROM_ALLOC) {
            legacy_access(m, &sim.objs[m->obj]);
            (void)sim_map_apply_prot(m); /* the own device keeps RW: no change */
        }
    }
}

static void pack_take(struct sim_pack *k, unsigned at, unsigned n, size_t bytes);

/* A private allocation of the current context's device (of `pool`'s when
 * given), mapped at a new VA: `bytes` as asked for, or a chunk for packed
 * requests (`pack` given, taken; bytes 0). With `pack`, the first request's
 * `units` are taken in it before anyone else can see the chunk. */
static CUresult alloc_fresh(CUdeviceptr *dptr, size_t bytes, int origin, struct sim_pool *pool,
                            struct sim_pack *pack, unsigned units)
{
    CUmemAllocationProp prop = {0};
    struct sim_obj *o = NULL;
    struct sim_map *m;
    uintptr_t va;
    size_t size;
    int dev;
    CUresult r;

    r = sim_current_dev(&dev);
    if (r != CUDA_SUCCESS)
        goto fail;
    if (bytes > UINT64_MAX - SIM_GRANULARITY) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
        goto fail;
    }
    size = pack ? SIM_GRANULARITY : (bytes + SIM_GRANULARITY - 1) & ~(SIM_GRANULARITY - 1);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = pool ? pool->dev : dev;
    if (pool)
        prop.requestedHandleTypes = (CUmemAllocationHandleType)pool->handle_types;
    sim_lock();
    r = create_alloc(&o, size, &prop);
    if (r == CUDA_SUCCESS) {
        o->legacy = 1;
        o->origin = origin;
        o->bytes = pack ? 0 : bytes;
        o->ctx = sim_current_ctx();
        o->pool = pool;
    }
    sim_unlock();
    if (r != CUDA_SUCCESS)
        goto fail;
    r = sim_map_fresh(o, &va);
    sim_lock();
    if (r != CUDA_SUCCESS) {
        o->handle_refs = 0;
        sim_obj_unref(o);
        sim_unlock();
        goto fail;
    }
    m = sim_map_find(va);
    legacy_access(m, o);
    r = sim_map_apply_prot(m);
    if (r == CUDA_SUCCESS && pack) {
        pack->base = va;
        pack_take(pack, 0, units, bytes);
        o->pack = pack;
        pack = NULL;
        sim.pack_hint = (int)(o - sim.objs);
    }
    sim_unlock();
    if (r != CUDA_SUCCESS) {
        sim_unmap_fresh(va);
        goto fail;
    }
    *dptr = (CUdeviceptr)va;
    return CUDA_SUCCESS;
fail:
    free(pack);
    return r;
}

/* ---- packed requests (struct sim_pack) -------------------------------- */

static void pack_take(struct sim_pack *k, unsigned at, unsigned n, size_t bytes)
{
    for (unsigned i = 0; i < n; i++)
        k->owner[at + i] = (uint16_t)(at + 1);
    k->sub[at].bytes = bytes;
    k->sub[at].id = ((unsigned long long)getpid() << 32) | ++sim.next_obj_id;
    k->live++;
    k->free_units -= n;
    k->next = at + n;
}

/* First fit of `n` units, after the previous request first; -1: none. */
static int pack_fit(const struct sim_pack *k, unsigned n)
{
    unsigned run = 0, i;

    if (k->free_units < n)
        return -1;
    for (i = 0; i < n && k->next + i < SIM_PACK_UNITS && !k->owner[k->next + i]; i++)
        ;
    if (i == n)
        return (int)k->next;
    for (unsigned u = 0; u < SIM_PACK_UNITS; u++) {
        run = k->owner[u] ? 0 : run + 1;
        if (run == n)
            return (int)(u + 1 - n);
    }
    return -1;
}

/* sim.mu held: a chunk of context `ctx` on `dev` with room for `n` units
 * (the last one used first), and where; NULL when none. */
static struct sim_obj *pack_find(const struct sim_ctx *ctx, int dev, unsigned n, int *at)
{
    for (int i = 0; i < SIM_MAX_OBJS; i++) {
        int j = (sim.pack_hint + i) % SIM_MAX_OBJS;
        struct sim_obj *o = &sim.objs[j];

        if (!o->used || !o->pack || o->released || o->ctx != ctx || o->props.loc_id != dev)
            continue;
        *at = pack_fit(o->pack, n);
        if (*at >= 0) {
            sim.pack_hint = j;
            return o;
        }
    }
    return NULL;
}

static CUresult pack_alloc(CUdeviceptr *dptr, size_t bytes)
{
    unsigned n = (unsigned)((bytes + SIM_PACK_UNIT - 1) / SIM_PACK_UNIT);
    struct sim_ctx *ctx = sim_current_ctx();
    struct sim_pack *k;
    struct sim_obj *o;
    int dev, at = -1;
    CUresult r = sim_current_dev(&dev);

    if (r != CUDA_SUCCESS)
        return r;
    sim_lock();
    o = pack_find(ctx, dev, n, &at);
    if (o) {
        pack_take(o->pack, (unsigned)at, n, bytes);
        *dptr = (CUdeviceptr)(o->pack->base + (unsigned)at * SIM_PACK_UNIT);
    }
    sim_unlock();
    if (o)
        return CUDA_SUCCESS;
    k = calloc(1, sizeof(*k));
    if (!k)
        return CUDA_ERROR_OUT_OF_MEMORY;
    k->free_units = SIM_PACK_UNITS;
    return alloc_fresh(dptr, bytes, SIM_FROM_ALLOC, NULL, k, n);
}

/* cuMemAlloc and its kin. Requests below the granularity are packed into
 * shared chunks (cuMemAlloc, cuMemAllocPitch: struct sim_pack); pool
 * memory keeps an allocation each (its own export and accounting). */
CUresult sim_mem_alloc_from(CUdeviceptr *dptr, size_t bytes, int origin, struct sim_pool *pool)
{
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (origin == SIM_FROM_ALLOC && bytes < SIM_GRANULARITY)
        return pack_alloc(dptr, bytes);
    return alloc_fresh(dptr, bytes, origin, pool, NULL, 0);
}

CUresult sim_mem_alloc(CUdeviceptr *dptr, size_t bytes)
{
    return sim_mem_alloc_from(dptr, bytes, SIM_FROM_ALLOC, NULL);
}

CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    SIM_API(sim_mem_alloc(dptr, bytesize));
}

/* Rows padded to SIM_PITCH_ALIGN bytes; the element size must be one of
 * cuda.h's and a row no wider than the device's maximum pitch. */
static CUresult alloc_pitch(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                            unsigned elem)
{
    size_t p;
    CUresult r;

    if (!dptr || !pitch || width == 0 || height == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (elem != 4 && elem != 8 && elem != 16)
        return CUDA_ERROR_INVALID_VALUE;
    /* The H200 took a row of 2^31 bytes (past CU_DEVICE_ATTRIBUTE_MAX_PITCH) and
     * refused one of 2^62 by 8 rows as INVALID_VALUE, not OUT_OF_MEMORY
     * (specs/records/2026-12-01-h200-fidelity.jsonl): a size that does not fit
     * is a bad value, one that fits is asked of the memory. */
    if (width > SIZE_MAX - (SIM_PITCH_ALIGN - 1))
        return CUDA_ERROR_INVALID_VALUE;
    p = (width + SIM_PITCH_ALIGN - 1) & ~(SIM_PITCH_ALIGN - 1);
    if (height > SIZE_MAX / p)
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_mem_alloc(dptr, p * height);
    if (r == CUDA_SUCCESS)
        *pitch = p;
    return r;
}

CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                    size_t Height, unsigned int ElementSizeBytes)
{
    SIM_API(alloc_pitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes));
}

/* The first unit of the packed request that starts exactly at `dptr` in
 * `m`'s chunk; -1 when `dptr` is no packed request's start. */
static int packed_first(const struct sim_map *m, CUdeviceptr dptr)
{
    const struct sim_pack *k = m ? sim.objs[m->obj].pack : NULL;
    uintptr_t off;

    if (!k || m->taken || (uintptr_t)dptr < m->va)
        return -1;
    off = (uintptr_t)dptr - (m->va - m->offset);
    if (off % SIM_PACK_UNIT || off >= SIM_GRANULARITY)
        return -1;
    off /= SIM_PACK_UNIT;
    return k->owner[off] == off + 1 && k->sub[off].bytes ? (int)off : -1;
}

/* What cuMemFree frees: memory from cuMemAlloc, a pool, or a pool import
 * (an IPC-opened pointer is closed by cuIpcCloseMemHandle instead), named
 * by the very pointer the allocation returned. */
static int freeable(const struct sim_map *m, CUdeviceptr dptr)
{
    int origin;

    if (m && sim.objs[m->obj].pack)
        return packed_first(m, dptr) >= 0;
    if (!m || m->va != (uintptr_t)dptr)
        return 0;
    origin = sim.objs[m->obj].origin;
    return origin == SIM_FROM_ALLOC || origin == SIM_FROM_POOL || origin == SIM_FROM_POOL_IMPORT;
}

int sim_mem_is_alloc(CUdeviceptr dptr)
{
    int ok;

    sim_lock();
    ok = freeable(sim_map_find((uintptr_t)dptr), dptr);
    sim_unlock();
    return ok;
}

/* sim.mu held: the packed request at unit `first` goes; 1 when it was its
 * chunk's last (the chunk goes then, as any allocation). */
static int pack_free(struct sim_pack *k, unsigned first)
{
    unsigned u;

    for (u = first; u < SIM_PACK_UNITS && k->owner[u] == first + 1; u++)
        k->owner[u] = 0;
    k->free_units += u - first;
    k->sub[first].bytes = 0;
    k->sub[first].id = 0;
    return --k->live == 0;
}

/* Checked and unmapped under one lock: of two frees racing, the loser
 * finds the mapping gone; the VA stays reserved until address_free. */
CUresult sim_mem_free(CUdeviceptr dptr)
{
    struct sim_map *m;
    uintptr_t va;
    size_t size;

    sim_lock();
    m = sim_map_find((uintptr_t)dptr);
    if (!freeable(m, dptr)) {
        sim_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (sim.objs[m->obj].pack &&
        !pack_free(sim.objs[m->obj].pack, (unsigned)packed_first(m, dptr))) {
        sim_unlock();
        return CUDA_SUCCESS;
    }
    va = m->va;
    size = m->size;
    sim.objs[m->obj].handle_refs = 0;
    unmap_one(m);
    sim_unlock();
    return address_free(va, size);
}

CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr)
{
    SIM_API(sim_mem_free(dptr));
}

/* The allocation holding `dptr`: a pointer's allocation as asked for
 * (cuMemAlloc, a pool, an IPC open), a VMM mapping's whole allocation. */
static CUresult address_range(CUdeviceptr *base, size_t *size, CUdeviceptr dptr)
{
    struct sim_map *m;
    CUresult r = CUDA_ERROR_NOT_FOUND;

    sim_lock();
    m = sim_map_find((uintptr_t)dptr);
    if (m && sim.objs[m->obj].legacy) {
        struct sim_span sp;

        if (sim_legacy_span(m, (uintptr_t)dptr, &sp)) {
            if (base)
                *base = sp.base;
            if (size)
                *size = sp.bytes;
            r = CUDA_SUCCESS;
        }
    } else if (m) {
        if (base)
            *base = m->va - m->offset;
        if (size)
            *size = sim.objs[m->obj].size;
        r = CUDA_SUCCESS;
    }
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    SIM_API(address_range(pbase, psize, dptr));
}
