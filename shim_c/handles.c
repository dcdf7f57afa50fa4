/*
 * The logical handle table, and adopting a driver handle into it.
 *
 * The application never holds a real driver handle for a tracked resource:
 * it holds SHIM_TAG | generation | slot. The real driver crashes on a handle
 * value it never gave out (SIGSEGV in cuMemRelease:
 * specs/records/2026-11-29-h200-driver-rules.jsonl), so a tagged value that
 * is unknown or dead is rejected here and never reaches the driver. Slots
 * are reused with a new generation, so a stale handle to a reused slot stays
 * dead. All functions run under g.lock.
 */
#include "shim.h"

#include <stdlib.h>
#include <string.h>

static struct obj **slots;
static uint32_t *slot_gen; /* last generation handed out per slot */
static uint32_t nslots;    /* slots in use or free: the table's length */
static uint32_t capslots;

static uint32_t next_gen(uint32_t prev)
{
    uint32_t g2 = (prev + 1) & SHIM_GEN_MASK;
    return g2 ? g2 : 1; /* generation 0 never appears in a handle */
}

struct obj *obj_new(enum obj_kind kind)
{
    uint32_t i;
    struct obj *o = calloc(1, sizeof *o);
    if (!o)
        return NULL;
    for (i = 0; i < nslots; i++)
        if (!slots[i])
            break;
    if (i == nslots) {
        if (nslots == capslots) {
            uint32_t nc = capslots ? capslots * 2 : 64;
            struct obj **ns;
            uint32_t *ng;
            if (nc > SHIM_SLOT_MASK + 1u)
                goto fail;
            ns = realloc(slots, nc * sizeof *ns);
            if (!ns)
                goto fail;
            slots = ns;
            ng = realloc(slot_gen, nc * sizeof *ng);
            if (!ng)
                goto fail;
            slot_gen = ng;
            memset(slots + capslots, 0, (nc - capslots) * sizeof *slots);
            memset(slot_gen + capslots, 0, (nc - capslots) * sizeof *slot_gen);
            capslots = nc;
        }
        nslots++;
    }
    o->slot = i;
    /* Each reuse of a slot gets the next generation: a stale handle to a
     * reused slot stays dead for 2^24 reuses of that very slot. */
    slot_gen[i] = next_gen(slot_gen[i]);
    o->gen = slot_gen[i];
    o->kind = (uint8_t)kind;
    shim_random_id(o->id);
    slots[i] = o;
    g.objs_gen++;
    return o;
fail:
    free(o);
    return NULL;
}

void obj_free(struct obj *o)
{
    if (!o)
        return;
    if (o->slot < nslots && slots[o->slot] == o)
        slots[o->slot] = NULL;
    g.objs_gen++;
    free(o->maps);
    free(o->binds);
    free(o->fetches);
    if (o->own)
        o->free_own(o->own); /* owned.c's own bookkeeping, freed by owned.c */
    free(o);
}

CUmemGenericAllocationHandle obj_handle(const struct obj *o)
{
    return (CUmemGenericAllocationHandle)((SHIM_TAG << SHIM_TAG_SHIFT) |
                                          ((uint64_t)o->gen << SHIM_GEN_SHIFT) | o->slot);
}

struct obj *obj_lookup(CUmemGenericAllocationHandle h, bool need_ref)
{
    uint64_t v = (uint64_t)h;
    uint32_t slot = (uint32_t)(v & SHIM_SLOT_MASK);
    uint32_t gen = (uint32_t)(v >> SHIM_GEN_SHIFT) & SHIM_GEN_MASK;
    struct obj *o;

    if (!SHIM_IS_TAGGED(v) || slot >= nslots)
        return NULL;
    o = slots[slot];
    if (!o || o->gen != gen)
        return NULL;
    if (need_ref && o->refs == 0)
        return NULL;
    return o;
}

struct obj *obj_by_id(const uint8_t id[CUIP_ID_LEN])
{
    for (uint32_t i = 0; i < nslots; i++)
        if (slots[i] && !memcmp(slots[i]->id, id, CUIP_ID_LEN))
            return slots[i];
    return NULL;
}

struct obj *obj_by_address(CUdeviceptr va, uint32_t *map_index)
{
    for (uint32_t i = 0; i < nslots; i++) {
        struct obj *o = slots[i];
        if (!o)
            continue;
        for (uint32_t k = 0; k < o->nmaps; k++) {
            const struct mapping *m = &o->maps[k];
            if (va >= m->va && va - m->va < m->size) {
                if (map_index)
                    *map_index = k;
                return o;
            }
        }
    }
    return NULL;
}

uint32_t obj_count(void)
{
    return nslots;
}

struct obj *obj_at(uint32_t i)
{
    return i < nslots ? slots[i] : NULL;
}

int obj_add_mapping(struct obj *o, const struct mapping *m)
{
    if (o->nmaps == o->capmaps) {
        uint32_t nc = o->capmaps ? o->capmaps * 2 : 4;
        struct mapping *nm = realloc(o->maps, nc * sizeof *nm);
        if (!nm)
            return -1;
        o->maps = nm;
        o->capmaps = nc;
    }
    o->maps[o->nmaps++] = *m;
    return 0;
}

int obj_add_fetch(struct obj *o, const char participant[CUIP_PARTICIPANT_LEN], pid_t pid)
{
    for (uint32_t i = 0; i < o->nfetches; i++) {
        if (!memcmp(o->fetches[i].participant, participant, CUIP_PARTICIPANT_LEN)) {
            o->fetches[i].pid = pid; /* the same participant again: a restored process */
            return 0;
        }
    }
    if (o->nfetches == o->capfetches) {
        uint32_t nc = o->capfetches ? o->capfetches * 2 : 4;
        struct fetch *nf = realloc(o->fetches, nc * sizeof *nf);
        if (!nf)
            return -1;
        o->fetches = nf;
        o->capfetches = nc;
    }
    memcpy(o->fetches[o->nfetches].participant, participant, CUIP_PARTICIPANT_LEN);
    o->fetches[o->nfetches++].pid = pid;
    return 0;
}

void obj_del_mapping(struct obj *o, uint32_t i)
{
    if (i >= o->nmaps)
        return;
    memmove(&o->maps[i], &o->maps[i + 1], (o->nmaps - i - 1) * sizeof *o->maps);
    o->nmaps--;
}

void obj_drop_all(void)
{
    for (uint32_t i = 0; i < nslots; i++) {
        if (slots[i]) {
            if (slots[i]->own)
                slots[i]->free_own(slots[i]->own);
            free(slots[i]->maps);
            free(slots[i]->binds);
            free(slots[i]->fetches);
            free(slots[i]);
        }
    }
    free(slots);
    free(slot_gen);
    slots = NULL;
    slot_gen = NULL;
    nslots = capslots = 0;
}

bool obj_unused(const struct obj *o)
{
    return o->refs == 0 && o->nmaps == 0;
}

void obj_release_if_unused(struct obj *o)
{
    if (!obj_unused(o))
        return;
    if (o->live) {
        CUresult r = real.cuMemRelease(o->real);
        if (r != CUDA_SUCCESS)
            shim_log(LOG_WARN, "cuMemRelease of a dead object failed: %s", shim_cu_name(r));
    }
    obj_free(o);
}

CUresult mapping_restore_access(const struct mapping *m, char *msg, size_t n)
{
    CUmemAccessDesc d[CUIP_ACCESS_MAX];
    CUresult r;

    if (m->access_count == 0)
        return CUDA_SUCCESS;
    memset(d, 0, sizeof d);
    for (uint32_t i = 0; i < m->access_count; i++) {
        d[i].location.type = (CUmemLocationType)m->access[i].location_type;
        d[i].location.id = m->access[i].location_id;
        d[i].flags = (CUmemAccess_flags)m->access[i].flags;
    }
    r = real.cuMemSetAccess(m->va, m->size, d, m->access_count);
    if (r != CUDA_SUCCESS) {
        CUresult u;
        shim_fail(msg, n, "cuMemSetAccess", r);
        /* Nothing half-done stays: a retry or a rollback maps it again. */
        u = real.cuMemUnmap(m->va, m->size);
        if (u != CUDA_SUCCESS)
            shim_log(LOG_WARN, "cuMemUnmap after a failed cuMemSetAccess failed: %s",
                     shim_cu_name(u));
    }
    return r;
}

int obj_ptr_id_cmp(const void *a, const void *b)
{
    const struct obj *const *x = a, *const *y = b;
    return memcmp((*x)->id, (*y)->id, CUIP_ID_LEN);
}

int mapping_va_cmp(const void *a, const void *b)
{
    const struct mapping *x = a, *y = b;
    return x->va < y->va ? -1 : x->va > y->va;
}

bool obj_shared(const struct obj *o)
{
    return o->kind == OBJ_ALLOC && !o->raw_import && !o->unsupported &&
           (o->exported || o->imported || o->mc_member);
}

bool obj_staged(const struct obj *o)
{
    if (!o || o->kind != OBJ_ALLOC || !o->is_creator || o->raw_import || o->unsupported)
        return false;
    return obj_shared(o) || shim_settings()->stage_private;
}

/* ------------------------------------------------------------ adoption */
/* Under g.lock: a new object of `kind` for the driver handle `h`, which the
 * application now holds once (live, the current context); NULL on ENOMEM,
 * after releasing `h`. */
struct obj *obj_adopt(enum obj_kind kind, CUmemGenericAllocationHandle h)
{
    struct obj *o = obj_new(kind);
    if (!o) {
        real.cuMemRelease(h);
        return NULL;
    }
    o->live = true;
    o->real = h;
    o->refs = 1;
    if (real.cuCtxGetCurrent(&o->ctx) != CUDA_SUCCESS)
        o->ctx = NULL;
    return o;
}

/* Under g.lock: adopt `h`, just created by the driver for the application,
 * with this participant as its creator. A handle in the shim's tag range is
 * refused; on failure `h` is released. */
CUresult obj_adopt_created(enum obj_kind kind, CUmemGenericAllocationHandle h, struct obj **out)
{
    struct obj *o;

    if (SHIM_IS_TAGGED(h)) {
        shim_log(LOG_ERROR, "driver handle %#llx collides with the shim's tag range; refused",
                 (unsigned long long)h);
        real.cuMemRelease(h);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    o = obj_adopt(kind, h);
    if (!o)
        return CUDA_ERROR_OUT_OF_MEMORY;
    o->is_creator = true;
    memcpy(o->creator, g.participant, CUIP_PARTICIPANT_LEN);
    *out = o;
    return CUDA_SUCCESS;
}
