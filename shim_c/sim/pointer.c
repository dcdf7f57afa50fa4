/* Pointer attributes: cuPointerGetAttribute and cuPointerGetAttributes.
 *
 * A pointer is device memory a pointer names (cuMemAlloc, a pool, an IPC
 * open or a pool import), VMM memory (a cuMemMap mapping, or reserved VA
 * with nothing mapped), host memory (cuMemHostAlloc, cuMemHostRegister),
 * or unknown. cuPointerGetAttribute answers CUDA_ERROR_INVALID_VALUE for an
 * unknown pointer and for an attribute that does not apply (a device
 * pointer's HOST_POINTER); cuPointerGetAttributes writes zeros there and
 * succeeds (cuda.h). Boolean attributes are written as 4-byte integers, as
 * the real driver writes them; each other attribute at the width cuda.h
 * gives its type. */
#include "sim.h"

#include <string.h>

/* Attributes a 13.0 header may not name yet. */
#define SIM_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE 21
#define SIM_POINTER_ATTRIBUTE_LOCALITY_DOMAIN_ORDINAL 22

enum ptr_kind { PTR_UNKNOWN = 0, PTR_DEVICE, PTR_RESERVED, PTR_HOST };

/* What sim.mu-held lookups found about a pointer. */
struct ptr_info {
    int kind;
    const struct sim_obj *o;   /* PTR_DEVICE */
    const struct sim_map *m;   /* PTR_DEVICE */
    const struct sim_host *h;  /* PTR_HOST */
    uintptr_t range_base;      /* RANGE_START_ADDR / RANGE_SIZE */
    size_t range_size;
    uintptr_t map_base;        /* MAPPING_BASE_ADDR / MAPPING_SIZE */
    size_t map_size;
    unsigned long long id;     /* memory a pointer names: BUFFER_ID, MEMORY_BLOCK_ID */
};

/* A VMM mapping as cuMemMap made it (cuMemSetAccess may have split it). */
static void map_group(const struct sim_map *m, uintptr_t *base, size_t *size)
{
    uintptr_t lo = m->va, hi = m->va + m->size;

    for (int i = 0; i < SIM_MAX_MAPS; i++) {
        const struct sim_map *n = &sim.maps[i];

        if (n->used && n->group == m->group) {
            if (n->va < lo)
                lo = n->va;
            if (n->va + n->size > hi)
                hi = n->va + n->size;
        }
    }
    *base = lo;
    *size = hi - lo;
}

static int in_reservation(uintptr_t p, uintptr_t *base, size_t *size)
{
    for (int i = 0; i < SIM_MAX_RESV; i++) {
        const struct sim_resv *r = &sim.resv[i];

        if (r->used && p >= r->base && p - r->base < r->size) {
            *base = r->base;
            *size = r->size;
            return 1;
        }
    }
    return 0;
}

/* 1: device memory; 0: none (a reservation may still hold it); -1: a free
 * part of a packed chunk, which nothing names. */
static int device_info(uintptr_t p, struct ptr_info *in)
{
    const struct sim_map *m = sim_map_find(p);

    if (!m || m->taken)
        return 0;
    in->m = m;
    in->o = &sim.objs[m->obj];
    if (in->o->legacy) {
        struct sim_span sp;

        /* Past what was asked for (the reservation's then), or a free part
         * of a packed chunk: no allocation names it (H200: a freed small
         * request's RANGE_START_ADDR is INVALID_VALUE beside a live one). */
        if (!sim_legacy_span(m, p, &sp))
            return in->o->pack ? -1 : 0;
        in->range_base = sp.base;
        in->range_size = sp.bytes;
        in->id = sp.id;
        in->map_base = m->va - m->offset;
        in->map_size = in->o->size;
    } else {
        map_group(m, &in->map_base, &in->map_size);
        if (!in_reservation(p, &in->range_base, &in->range_size))
            return 0;
    }
    in->kind = PTR_DEVICE;
    return 1;
}

static void ptr_lookup(uintptr_t p, struct ptr_info *in)
{
    int found;

    memset(in, 0, sizeof(*in));
    found = p == 0 ? 0 : device_info(p, in);
    if (found < 0)
        memset(in, 0, sizeof(*in));
    if (p == 0 || found != 0)
        return;
    if (in_reservation(p, &in->range_base, &in->range_size)) {
        in->kind = PTR_RESERVED;
        return;
    }
    for (int i = 0; i < SIM_MAX_HOST; i++) {
        const struct sim_host *h = &sim.host[i];

        if (h->used && p >= (uintptr_t)h->p && p - (uintptr_t)h->p < h->size) {
            in->kind = PTR_HOST;
            in->h = h;
            in->range_base = in->map_base = (uintptr_t)h->p;
            in->range_size = in->map_size = h->size;
            return;
        }
    }
}

/* The width of each attribute's value; 0: not an attribute. */
static size_t attr_width(int attr)
{
    switch (attr) {
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
    case SIM_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE:
    case SIM_POINTER_ATTRIBUTE_LOCALITY_DOMAIN_ORDINAL:
        return 4;
    default:
        return 0;
    }
}

static unsigned access_flag(unsigned mem_access)
{
    if (mem_access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        return CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE;
    if (mem_access == CU_MEM_ACCESS_FLAGS_PROT_READ)
        return CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ;
    return CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE;
}

/* Device memory's attributes; VMM memory belongs to no context. */
static CUresult device_attr(int attr, const struct ptr_info *in, uintptr_t p,
                            const struct sim_ctx *cur, uint64_t *v)
{
    const struct sim_obj *o = in->o;

    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *v = o->legacy ? (uint64_t)(uintptr_t)o->ctx : 0; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *v = CU_MEMORYTYPE_DEVICE; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *v = p; break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: return CUDA_ERROR_INVALID_VALUE;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        /* A mapping's own: two mappings of one allocation are two buffers. */
        *v = o->legacy ? in->id : ((uint64_t)1 << 48) + (uint64_t)in->m->group;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *v = (uint64_t)o->props.loc_id; break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *v = o->origin == SIM_FROM_ALLOC; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *v = 1; break;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: *v = o->props.handle_types; break;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
        /* An IPC open is not (seen on the H200), its creator's memory is. */
        *v = o->origin == SIM_FROM_ALLOC || o->origin == SIM_FROM_POOL || o->props.rdma;
        break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: *v = access_flag(in->m->access[cur->dev]); break;
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
        *v = o->origin == SIM_FROM_POOL || o->origin == SIM_FROM_POOL_IMPORT
                 ? (uint64_t)(uintptr_t)o->pool
                 : 0;
        break;
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: *v = o->legacy ? in->id : o->id; break;
    default: return CUDA_ERROR_NOT_FOUND; /* shared with host memory */
    }
    return CUDA_SUCCESS;
}

static CUresult host_attr(int attr, const struct ptr_info *in, uintptr_t p,
                          const struct sim_ctx *cur, uint64_t *v)
{
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *v = (uint64_t)(uintptr_t)cur; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *v = CU_MEMORYTYPE_HOST; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: /* unified addressing */
    case CU_POINTER_ATTRIBUTE_HOST_POINTER: *v = p; break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        *v = ((uint64_t)2 << 48) + (uint64_t)(in->h - sim.host);
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *v = (uint64_t)cur->dev; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *v = 1; break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: *v = CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE; break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: *v = 0; break;
    default: return CUDA_ERROR_NOT_FOUND;
    }
    return CUDA_SUCCESS;
}

/* One attribute of a known pointer (sim.mu held). */
static CUresult attr_value(int attr, const struct ptr_info *in, uintptr_t p, uint64_t *v)
{
    const struct sim_ctx *cur = sim_current_ctx();
    CUresult r;

    *v = 0;
    if (!cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: /* no cuPointerSetAttribute here */
    case SIM_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE:
        return in->kind == PTR_UNKNOWN ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    case SIM_POINTER_ATTRIBUTE_LOCALITY_DOMAIN_ORDINAL:
        *v = (uint64_t)(uint32_t)-1; /* not localized */
        return in->kind == PTR_UNKNOWN ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *v = in->range_base;
        return in->kind == PTR_UNKNOWN ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *v = in->range_size;
        return in->kind == PTR_UNKNOWN ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        *v = in->map_base;
        return in->kind == PTR_DEVICE || in->kind == PTR_HOST ? CUDA_SUCCESS
                                                              : CUDA_ERROR_INVALID_VALUE;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
        *v = in->map_size;
        return in->kind == PTR_DEVICE || in->kind == PTR_HOST ? CUDA_SUCCESS
                                                              : CUDA_ERROR_INVALID_VALUE;
    default:
        break;
    }
    if (in->kind == PTR_RESERVED && attr == CU_POINTER_ATTRIBUTE_MAPPED)
        return CUDA_SUCCESS; /* reserved, nothing mapped: 0 */
    if (in->kind == PTR_DEVICE)
        r = device_attr(attr, in, p, cur, v);
    else if (in->kind == PTR_HOST)
        r = host_attr(attr, in, p, cur, v);
    else
        r = CUDA_ERROR_INVALID_VALUE;
    return r == CUDA_ERROR_NOT_FOUND ? CUDA_ERROR_INVALID_VALUE : r;
}

static void put(void *data, uint64_t v, size_t width)
{
    if (width == 8) {
        memcpy(data, &v, 8);
    } else {
        uint32_t w = (uint32_t)v;

        memcpy(data, &w, 4);
    }
}

static CUresult get_attribute(void *data, int attr, CUdeviceptr ptr)
{
    struct ptr_info in;
    size_t width = attr_width(attr);
    uint64_t v;
    CUresult r;

    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    if (attr == CU_POINTER_ATTRIBUTE_P2P_TOKENS)
        return CUDA_ERROR_NOT_SUPPORTED; /* no nv-p2p kernel interface here */
    if (width == 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    ptr_lookup((uintptr_t)ptr, &in);
    r = attr_value(attr, &in, (uintptr_t)ptr, &v);
    sim_unlock();
    if (r == CUDA_SUCCESS)
        put(data, v, width);
    return r;
}

CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    SIM_API(get_attribute(data, (int)attribute, ptr));
}

/* Every attribute checked before any is written. */
static CUresult get_attributes(unsigned n, const CUpointer_attribute *attrs, void **data,
                               CUdeviceptr ptr)
{
    struct ptr_info in;

    if (n == 0 || !attrs || !data)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < n; i++)
        if (!data[i] || attr_width((int)attrs[i]) == 0)
            return CUDA_ERROR_INVALID_VALUE;
    if (!sim_current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_lock();
    ptr_lookup((uintptr_t)ptr, &in);
    for (unsigned i = 0; i < n; i++) {
        uint64_t v = 0;

        /* What does not apply reads as zero (NULL), not as an error. */
        if (attr_value((int)attrs[i], &in, (uintptr_t)ptr, &v) != CUDA_SUCCESS)
            v = 0;
        put(data[i], v, attr_width((int)attrs[i]));
    }
    sim_unlock();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuPointerGetAttributes(unsigned int numAttributes,
                                        CUpointer_attribute *attributes, void **data,
                                        CUdeviceptr ptr)
{
    SIM_API(get_attributes(numAttributes, attributes, data, ptr));
}
