/*
 * Multicast teams: the application's multicast calls (tracked like unicast:
 * logical handles, the team recorded), and the multicast phase work.
 *
 * What a process records per object: the properties and context at create
 * (or, for an importer, the capability's), the devices it added, every
 * binding it made (BIND_MEM with member id and offset; BIND_ADDR with the
 * address, and the member when the address lies in a tracked mapping; the
 * API version and the device), and its mappings of the object (VA, offset,
 * flags, merged access; `o->maps`, kept by unicast.c's generic calls).
 *
 * Capture (PREPARE_MULTICAST), per object in its context: unmap every
 * mapping (the reservation stays), unbind every binding, release the
 * driver handle. The shim's own reference outlives the application's
 * handle while a mapping lives, so an object whose handle the application
 * released is torn down through that reference.
 *
 * Restore, one barrier each: creators create (original properties),
 * importers fetch a fresh export from the creator and import it, everyone
 * adds the devices it had added, then binds are replayed and the mappings
 * mapped again with their flags and access. The application's logical
 * handles keep working: they name the object, not the driver handle.
 *
 * Binds and maps of a multicast object block in the driver until every
 * device of the team was added, so g.lock is never held across them (nor
 * across a peer request). An application bind or map in flight is counted
 * (`calls_in_flight`, under g.lock): capture and rollback refuse to start
 * while one is, so none completes into a torn-down team. The shim's own
 * binds and maps (restore, rollback) wait at most the peer timeout for the
 * team: a participant that died would otherwise hold the others in the
 * driver for ever (the real driver has no deadline). They run on a helper
 * thread that is left behind, blocked, when the wait gives up.
 */
#include "shim.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>


static uint32_t calls_in_flight; /* under g.lock */

/* "multicast object <hex id>" into `out` (at least 2 * CUIP_ID_LEN + 1). */
static void id_text(char *out, const uint8_t id[CUIP_ID_LEN])
{
    shim_hex(out, id, CUIP_ID_LEN);
    out[2 * CUIP_ID_LEN] = 0;
}

static bool supported(const struct obj *o)
{
    return (o->handle_types & ~(uint64_t)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0;
}

static bool is_mc(const struct obj *o)
{
    return o && o->kind == OBJ_MC && !obj_unused(o);
}

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

/* ------------------------------------------------------------ application calls */
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
    o->unsupported = !supported(o);
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
    if (!translate(mcHandle, &h, &o) || (o && o->kind != OBJ_MC)) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    if (o && (dev < 0 || dev >= MAX_DEVICES)) {
        /* Recorded as a bit: a device beyond that could not be rebuilt. */
        r = CUDA_ERROR_INVALID_DEVICE;
        goto out;
    }
    /* Adding a device does not wait for the team. */
    r = real.cuMulticastAddDevice(h, dev);
    if (r == CUDA_SUCCESS && o) {
        o->mc_devices |= 1ull << dev;
        o->mc_joined = true;
    }
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

static int add_binding(struct obj *o, const struct mc_binding *b)
{
    if (o->nbinds == o->capbinds) {
        uint32_t nc = o->capbinds ? o->capbinds * 2 : 4;
        struct mc_binding *nb = realloc(o->binds, nc * sizeof *nb);
        if (!nb)
            return -1;
        o->binds = nb;
        o->capbinds = nc;
    }
    o->binds[o->nbinds++] = *b;
    return 0;
}

/* The driver's bind for `b` on the driver handles `mc` and `mem`. */
static CUresult bind_real(CUmemGenericAllocationHandle mc, const struct mc_binding *b,
                          CUmemGenericAllocationHandle mem, const char **call)
{
    bool by_mem = b->kind == CUIP_BIND_MEM;

    if (b->api_version == 2) {
        *call = by_mem ? "cuMulticastBindMem_v2" : "cuMulticastBindAddr_v2";
        if (by_mem ? !real.cuMulticastBindMem_v2 : !real.cuMulticastBindAddr_v2)
            return CUDA_ERROR_NOT_SUPPORTED;
        return by_mem ? real.cuMulticastBindMem_v2(mc, b->device, b->mc_offset, mem,
                                                   b->member_offset, b->size, b->flags)
                      : real.cuMulticastBindAddr_v2(mc, b->device, b->mc_offset, b->address,
                                                    b->size, b->flags);
    }
    *call = by_mem ? "cuMulticastBindMem" : "cuMulticastBindAddr";
    return by_mem ? real.cuMulticastBindMem(mc, b->mc_offset, mem, b->member_offset, b->size,
                                            b->flags)
                  : real.cuMulticastBindAddr(mc, b->mc_offset, b->address, b->size, b->flags);
}

/* Under g.lock: which tracked allocation `b` binds, filling member_id,
 * member_offset (BIND_ADDR) and, for the 12.1 forms, the device. */
static struct obj *resolve_member(struct mc_binding *b, struct obj *by_handle)
{
    struct obj *member = by_handle;
    uint32_t k;

    if (b->kind == CUIP_BIND_ADDR) {
        member = obj_by_address(b->address, &k);
        if (member && member->kind == OBJ_ALLOC)
            b->member_offset = member->maps[k].offset + (b->address - member->maps[k].va);
        else
            member = NULL;
    }
    if (member && member->kind != OBJ_ALLOC)
        member = NULL;
    if (member)
        memcpy(b->member_id, member->id, CUIP_ID_LEN);
    if (b->api_version == 1) {
        CUdevice dev = -1;
        if (member && member->prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE)
            dev = member->prop.location.id;
        else if (real.cuCtxGetDevice(&dev) != CUDA_SUCCESS)
            dev = -1;
        b->device = dev;
    }
    return member;
}

/* Every application bind: translate and record under g.lock, bind without
 * it (the driver waits for the whole team). The objects are pinned by a
 * temporary application reference meanwhile. */
static CUresult app_bind(CUmemGenericAllocationHandle mcHandle, struct mc_binding *b,
                         CUmemGenericAllocationHandle memHandle)
{
    CUmemGenericAllocationHandle rmc, rmem = 0;
    struct obj *o, *mem_obj = NULL, *member;
    const char *call;
    CUresult r = app_lock();

    if (r != CUDA_SUCCESS)
        return r;
    if (!translate(mcHandle, &rmc, &o) || (o && o->kind != OBJ_MC) ||
        (b->kind == CUIP_BIND_MEM && !translate(memHandle, &rmem, &mem_obj))) {
        pthread_mutex_unlock(&g.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    member = resolve_member(b, mem_obj);
    if (o)
        o->refs++;
    if (member)
        member->refs++;
    calls_in_flight++;
    pthread_mutex_unlock(&g.lock);

    r = bind_real(rmc, b, rmem, &call);

    pthread_mutex_lock(&g.lock);
    calls_in_flight--;
    if (member) {
        if (r == CUDA_SUCCESS)
            member->mc_member = true; /* its bytes are saved and restored from now on */
        member->refs--;
        obj_release_if_unused(member);
    }
    if (o) {
        b->bound = true;
        if (r == CUDA_SUCCESS && add_binding(o, b) != 0) {
            shim_log(LOG_ERROR, "out of memory recording a multicast binding; unbound");
            real.cuMulticastUnbind(rmc, b->device, b->mc_offset, b->size);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
        o->refs--;
        obj_release_if_unused(o);
    }
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuMulticastBindMem(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                    CUmemGenericAllocationHandle memHandle, size_t memOffset,
                                    size_t size, unsigned long long flags)
{
    struct mc_binding b = {.kind = CUIP_BIND_MEM, .api_version = 1, .mc_offset = mcOffset,
                           .size = size, .member_offset = memOffset, .flags = flags};
    return app_bind(mcHandle, &b, memHandle);
}

CUresult CUDAAPI cuMulticastBindMem_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                       size_t mcOffset, CUmemGenericAllocationHandle memHandle,
                                       size_t memOffset, size_t size, unsigned long long flags)
{
    struct mc_binding b = {.kind = CUIP_BIND_MEM, .api_version = 2, .device = dev,
                           .mc_offset = mcOffset, .size = size, .member_offset = memOffset,
                           .flags = flags};

    if (!shim_resolve_real() || !real.cuMulticastBindMem_v2)
        return CUDA_ERROR_NOT_SUPPORTED;
    return app_bind(mcHandle, &b, memHandle);
}

CUresult CUDAAPI cuMulticastBindAddr(CUmemGenericAllocationHandle mcHandle, size_t mcOffset,
                                     CUdeviceptr memptr, size_t size, unsigned long long flags)
{
    struct mc_binding b = {.kind = CUIP_BIND_ADDR, .api_version = 1, .mc_offset = mcOffset,
                           .size = size, .address = memptr, .flags = flags};
    return app_bind(mcHandle, &b, 0);
}

CUresult CUDAAPI cuMulticastBindAddr_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                        size_t mcOffset, CUdeviceptr memptr, size_t size,
                                        unsigned long long flags)
{
    struct mc_binding b = {.kind = CUIP_BIND_ADDR, .api_version = 2, .device = dev,
                           .mc_offset = mcOffset, .size = size, .address = memptr,
                           .flags = flags};

    if (!shim_resolve_real() || !real.cuMulticastBindAddr_v2)
        return CUDA_ERROR_NOT_SUPPORTED;
    return app_bind(mcHandle, &b, 0);
}

CUresult CUDAAPI cuMulticastUnbind(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                   size_t mcOffset, size_t size)
{
    CUmemGenericAllocationHandle rmc;
    struct obj *o;
    CUresult r;

    if ((r = app_lock()) != CUDA_SUCCESS)
        return r;
    if (!translate(mcHandle, &rmc, &o) || (o && o->kind != OBJ_MC)) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    /* Unbinding does not wait for the team. */
    r = real.cuMulticastUnbind(rmc, dev, mcOffset, size);
    if (r != CUDA_SUCCESS || !o)
        goto out;
    for (uint32_t i = 0; i < o->nbinds; i++) {
        const struct mc_binding *b = &o->binds[i];
        if (b->device == dev && b->mc_offset == mcOffset && b->size == size) {
            o->binds[i] = o->binds[--o->nbinds];
            break;
        }
    }
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult multicast_map(struct obj *o, CUdeviceptr ptr, size_t size, size_t offset,
                       unsigned long long flags)
{
    CUmemGenericAllocationHandle h = o->real;
    struct mapping m;
    CUresult r;

    o->refs++;
    calls_in_flight++;
    pthread_mutex_unlock(&g.lock);
    r = real.cuMemMap(ptr, size, offset, h, flags);
    pthread_mutex_lock(&g.lock);
    calls_in_flight--;
    o->refs--;
    if (r == CUDA_SUCCESS) {
        memset(&m, 0, sizeof m);
        m.va = ptr;
        m.size = size;
        m.offset = offset;
        m.flags = flags;
        if (obj_add_mapping(o, &m) != 0) {
            real.cuMemUnmap(ptr, size);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (r == CUDA_SUCCESS)
        o->mc_mapped = true;
    obj_release_if_unused(o);
    return r;
}

/* ------------------------------------------------------------ INSPECT */
static int binding_cmp(const void *a, const void *b)
{
    const struct mc_binding *x = a, *y = b;
    if (x->device != y->device)
        return x->device < y->device ? -1 : 1;
    return x->mc_offset < y->mc_offset ? -1 : x->mc_offset > y->mc_offset;
}

uint32_t multicast_unsupported(void)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < obj_count(); i++)
        if (is_mc(obj_at(i)) && obj_at(i)->unsupported)
            n++;
    return n;
}

uint32_t multicast_record_count(void)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < obj_count(); i++) {
        const struct obj *o = obj_at(i);
        if (!is_mc(o))
            continue;
        n += o->unsupported ? 1u
                            : 1u + (uint32_t)__builtin_popcountll(o->mc_devices) + o->nbinds +
                                  o->nmaps;
    }
    return n;
}

static struct cuip_record *rec_new(struct reply *r, uint16_t kind, const struct obj *o)
{
    struct cuip_record *rec = &r->records[r->h.count++];
    memset(rec, 0, sizeof *rec);
    rec->kind = kind;
    memcpy(rec->id, o->id, CUIP_ID_LEN);
    return rec;
}

static void inspect_object(struct reply *r, struct obj *o)
{
    struct cuip_record *rec = rec_new(r, CUIP_RECORD_MC_OBJECT, o);

    rec->flags = (uint16_t)((o->is_creator ? CUIP_FLAG_CREATOR : 0) |
                            (o->refs > 0 ? CUIP_FLAG_HANDLE_LIVE : 0));
    memcpy(rec->creator, o->creator, CUIP_PARTICIPANT_LEN);
    rec->size = o->size;
    rec->handle_types = o->handle_types;
    rec->num_devices = o->mcprop.numDevices;
    rec->object_flags = o->mcprop.flags;
    rec->handle_count = o->refs;
    for (int d = 0; d < MAX_DEVICES; d++) {
        if (!(o->mc_devices & (1ull << d)))
            continue;
        rec = rec_new(r, CUIP_RECORD_MC_DEVICE, o);
        rec->device = d;
    }
    if (o->nbinds > 1)
        qsort(o->binds, o->nbinds, sizeof *o->binds, binding_cmp);
    for (uint32_t k = 0; k < o->nbinds; k++) {
        const struct mc_binding *b = &o->binds[k];
        rec = rec_new(r, CUIP_RECORD_MC_BINDING, o);
        rec->binding_kind = b->kind;
        rec->api_version = b->api_version;
        rec->device = b->device;
        rec->offset = b->mc_offset;
        rec->size = b->size;
        memcpy(rec->member_id, b->member_id, CUIP_ID_LEN);
        rec->member_offset = b->member_offset;
        rec->address = b->kind == CUIP_BIND_ADDR ? b->address : 0;
        rec->op_flags = b->flags;
    }
    if (o->nmaps > 1)
        qsort(o->maps, o->nmaps, sizeof *o->maps, mapping_va_cmp);
    for (uint32_t k = 0; k < o->nmaps; k++) {
        const struct mapping *m = &o->maps[k];
        rec = rec_new(r, CUIP_RECORD_MC_MAPPING, o);
        rec->address = m->va;
        rec->size = m->size;
        rec->offset = m->offset;
        rec->op_flags = m->flags;
        rec->access_count = m->access_count;
        memcpy(rec->access, m->access, m->access_count * sizeof m->access[0]);
    }
}

void multicast_inspect(struct reply *r)
{
    uint32_t n = 0;
    struct obj **list = calloc(obj_count() ? obj_count() : 1, sizeof *list);

    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!is_mc(o))
            continue;
        if (o->unsupported) {
            struct cuip_record *rec = rec_new(r, CUIP_RECORD_UNSUPPORTED_EXPORTABLE, o);
            memset(rec->id, 0, CUIP_ID_LEN);
            rec->handle_types = o->handle_types;
            rec->size = o->size;
        } else if (list) {
            list[n++] = o;
        }
    }
    if (!list) {
        /* Without the sort the records are still complete, in slot order. */
        for (uint32_t i = 0; i < obj_count(); i++)
            if (is_mc(obj_at(i)) && !obj_at(i)->unsupported)
                inspect_object(r, obj_at(i));
        return;
    }
    if (n > 1)
        qsort(list, n, sizeof *list, obj_ptr_id_cmp);
    for (uint32_t i = 0; i < n; i++)
        inspect_object(r, list[i]);
    free(list);
}

/* ------------------------------------------------------------ phase work */
/* The EXPORT server reads `live` and `real` under g.lock. */
static void set_live(struct obj *o, bool live, CUmemGenericAllocationHandle h)
{
    pthread_mutex_lock(&g.lock);
    o->live = live;
    o->real = h;
    pthread_mutex_unlock(&g.lock);
}

/* A CUDA_FAILED reply naming the op and the object. */
static void fail_reply(struct reply *r, const char *op, const struct obj *o, const char *msg)
{
    char id[2 * CUIP_ID_LEN + 1];
    id_text(id, o->id);
    reply_msg(r, CUIP_STATUS_CUDA_FAILED, "%s: multicast object %s: %s", op, id, msg);
}

/* Unmap, unbind, release; each step skipped when already done, so that a
 * rollback finishes a teardown that failed halfway. */
static int teardown(struct obj *o, char *msg, size_t n)
{
    bool pushed;
    CUresult cr = shim_ctx_enter(o->ctx, &pushed);

    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", cr);
        return -1;
    }
    if (o->mc_mapped) {
        for (uint32_t k = 0; k < o->nmaps; k++) {
            /* The reservation stays: the application holds those pointers. */
            cr = real.cuMemUnmap(o->maps[k].va, o->maps[k].size);
            if (cr != CUDA_SUCCESS) {
                shim_fail(msg, n, "cuMemUnmap", cr);
                goto fail;
            }
        }
        o->mc_mapped = false;
    }
    for (uint32_t k = 0; k < o->nbinds; k++) {
        struct mc_binding *b = &o->binds[k];
        if (!b->bound)
            continue;
        cr = real.cuMulticastUnbind(o->real, b->device, b->mc_offset, b->size);
        if (cr != CUDA_SUCCESS) {
            shim_fail(msg, n, "cuMulticastUnbind", cr);
            goto fail;
        }
        b->bound = false;
    }
    if (o->live) {
        CUmemGenericAllocationHandle h = o->real;
        set_live(o, false, 0); /* EXPORT stops serving it before it goes away */
        cr = real.cuMemRelease(h);
        if (cr != CUDA_SUCCESS) {
            shim_fail(msg, n, "cuMemRelease", cr);
            goto fail;
        }
    }
    o->mc_joined = false;
    shim_ctx_leave(pushed);
    return 0;
fail:
    shim_ctx_leave(pushed);
    return -1;
}

/* The object's driver handle again after a restore or a rollback: live, its
 * devices still to be added. */
static int adopt_again(struct obj *o, CUmemGenericAllocationHandle h, char *msg, size_t n)
{
    if (SHIM_IS_TAGGED(h)) {
        real.cuMemRelease(h);
        snprintf(msg, n, "driver handle collides with the shim's tag range");
        return -1;
    }
    o->mc_joined = false;
    set_live(o, true, h);
    return 0;
}

static int create(struct obj *o, char *msg, size_t n)
{
    CUmemGenericAllocationHandle h;
    bool pushed;
    CUresult cr = shim_ctx_enter(o->ctx, &pushed);

    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", cr);
        return -1;
    }
    cr = real.cuMulticastCreate(&h, &o->mcprop);
    shim_ctx_leave(pushed);
    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMulticastCreate", cr);
        return -1;
    }
    return adopt_again(o, h, msg, n);
}

/* A fresh export from the creator, imported; the peer request runs without
 * g.lock (the creator may be asking us meanwhile). */
static int import(struct obj *o, char *msg, size_t n)
{
    CUmemGenericAllocationHandle h;

    if (cap_import_again(o, &h, msg, n) != 0)
        return -1;
    return adopt_again(o, h, msg, n);
}

static int join(struct obj *o, char *msg, size_t n)
{
    bool pushed;
    CUresult cr = shim_ctx_enter(o->ctx, &pushed);

    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", cr);
        return -1;
    }
    for (int d = 0; d < MAX_DEVICES; d++) {
        if (!(o->mc_devices & (1ull << d)))
            continue;
        cr = real.cuMulticastAddDevice(o->real, d);
        if (cr != CUDA_SUCCESS) {
            shim_fail(msg, n, "cuMulticastAddDevice", cr);
            snprintf(msg + strnlen(msg, n), n - strnlen(msg, n), " (device %d)", d);
            shim_ctx_leave(pushed);
            return -1;
        }
    }
    o->mc_joined = true;
    shim_ctx_leave(pushed);
    return 0;
}

/* A bind or a map on a helper thread, so that the wait for the team is
 * bounded. Shared by the caller and the helper; the last one frees it. */
struct team_call {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool done;
    CUresult result;
    CUcontext ctx;
    bool is_map;
    CUmemGenericAllocationHandle mc, mem;
    struct mc_binding b;
    struct mapping m;
    const char *call;
};

static void team_call_put(struct team_call *c)
{
    bool last;

    pthread_mutex_lock(&c->mu);
    last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (!last)
        return;
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static void *team_call_main(void *arg)
{
    struct team_call *c = arg;
    bool pushed;
    CUresult r = shim_ctx_enter(c->ctx, &pushed);

    if (r == CUDA_SUCCESS) {
        r = c->is_map ? real.cuMemMap(c->m.va, c->m.size, c->m.offset, c->mc, c->m.flags)
                      : bind_real(c->mc, &c->b, c->mem, &c->call);
        shim_ctx_leave(pushed);
    }
    pthread_mutex_lock(&c->mu);
    c->result = r;
    c->done = true;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    team_call_put(c);
    return NULL;
}

/* Run `c` (refs 1, filled in) on a helper thread and wait for it at most the
 * peer timeout. On a timeout the helper is left blocked in the driver (it
 * frees `c` when it returns) and -1 comes back with the reason in msg. */
static int team_call_run(struct team_call *c, char *msg, size_t n)
{
    long ms = shim_settings()->peer_timeout_ms;
    const char *call = c->is_map ? "cuMemMap" : "the bind";
    struct timespec until;
    pthread_attr_t at;
    pthread_t t;
    int e = 0, rc = 0;

    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->refs = 2;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, team_call_main, c) != 0) {
        pthread_attr_destroy(&at);
        c->refs = 1;
        team_call_put(c);
        snprintf(msg, n, "cannot start a thread for %s", call);
        return -1;
    }
    pthread_attr_destroy(&at);
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += ms / 1000;
    until.tv_nsec += (ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&c->mu);
    while (!c->done && e != ETIMEDOUT)
        e = pthread_cond_timedwait(&c->cv, &c->mu, &until);
    if (!c->done) {
        snprintf(msg, n,
                 "%s still waits for the team after %ld ms: a participant did not add its "
                 "device (gone?)",
                 c->is_map ? "cuMemMap" : c->b.kind == CUIP_BIND_MEM ? "the BIND_MEM"
                                                                      : "the BIND_ADDR",
                 ms);
        rc = -1;
    } else if (c->result != CUDA_SUCCESS) {
        shim_fail(msg, n, c->is_map ? "cuMemMap" : c->call, c->result);
        rc = -1;
    }
    pthread_mutex_unlock(&c->mu);
    team_call_put(c);
    return rc;
}

static struct team_call *team_call_new(const struct obj *o)
{
    struct team_call *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->ctx = o->ctx;
    c->mc = o->real;
    c->call = "the bind";
    return c;
}

/* Bind `b` of `o` to `mem` with a bounded wait for the team. */
static int bind_bounded(const struct obj *o, const struct mc_binding *b,
                        CUmemGenericAllocationHandle mem, char *msg, size_t n)
{
    struct team_call *c = team_call_new(o);

    if (!c) {
        snprintf(msg, n, "out of memory");
        return -1;
    }
    c->b = *b;
    c->mem = mem;
    return team_call_run(c, msg, n);
}

/* Map `m` of `o` and apply its access again: mapping does not restore it. */
static CUresult map_one(const struct obj *o, const struct mapping *m, char *msg, size_t n)
{
    struct team_call *c = team_call_new(o);

    if (!c) {
        snprintf(msg, n, "out of memory");
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->is_map = true;
    c->m = *m;
    if (team_call_run(c, msg, n) != 0)
        return CUDA_ERROR_TIMEOUT; /* or the map's own error: msg says which */
    return mapping_restore_access(m, msg, n);
}

/* Replay every binding not held, then map every mapping (both wait for the
 * team in the driver; g.lock is not held). */
static int bind_and_map(struct obj *o, char *msg, size_t n)
{
    bool pushed;
    uint32_t k;
    CUresult cr = shim_ctx_enter(o->ctx, &pushed);

    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", cr);
        return -1;
    }
    for (k = 0; k < o->nbinds; k++) {
        struct mc_binding *b = &o->binds[k];
        CUmemGenericAllocationHandle mem = 0;

        if (b->bound)
            continue;
        if (b->kind == CUIP_BIND_MEM) {
            struct obj *member;
            char id[2 * CUIP_ID_LEN + 1];

            pthread_mutex_lock(&g.lock);
            member = obj_by_id(b->member_id);
            if (member && member->kind == OBJ_ALLOC && member->live)
                mem = member->real;
            pthread_mutex_unlock(&g.lock);
            if (!mem) {
                id_text(id, b->member_id);
                snprintf(msg, n, "member allocation %s of the binding on device %d is not loaded",
                         id, b->device);
                goto fail;
            }
        }
        if (bind_bounded(o, b, mem, msg, n) != 0) {
            snprintf(msg + strnlen(msg, n), n - strnlen(msg, n),
                     " (device %d, offset %#llx, size %#llx)", b->device,
                     (unsigned long long)b->mc_offset, (unsigned long long)b->size);
            goto fail;
        }
        b->bound = true;
    }
    if (!o->mc_mapped) {
        for (k = 0; k < o->nmaps; k++)
            if (map_one(o, &o->maps[k], msg, n) != CUDA_SUCCESS)
                break;
        if (k < o->nmaps) {
            while (k-- > 0)
                real.cuMemUnmap(o->maps[k].va, o->maps[k].size);
            goto fail;
        }
        o->mc_mapped = o->nmaps > 0;
    }
    shim_ctx_leave(pushed);
    return 0;
fail:
    shim_ctx_leave(pushed);
    return -1;
}

typedef int step_fn(struct obj *o, char *msg, size_t n);

/* Under no lock: run `step` on every object that `wants` it; the first
 * failure fails the op with the object named. */
static enum phase_result each_object(struct reply *r, const char *op,
                                     bool (*wants)(const struct obj *), step_fn *step)
{
    char msg[512];

    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        /* An unsupported object was never torn down (capture refuses it). */
        if (!is_mc(o) || o->unsupported || !wants(o))
            continue;
        msg[0] = 0;
        if (step(o, msg, sizeof msg) != 0) {
            fail_reply(r, op, o, msg);
            return PHASE_FAILED;
        }
    }
    return PHASE_DONE;
}

static bool any(const struct obj *o)
{
    (void)o;
    return true;
}

static bool dead_creator(const struct obj *o)
{
    return o->is_creator && !o->live;
}

static bool dead_import(const struct obj *o)
{
    return !o->is_creator && !o->live;
}

static bool not_joined(const struct obj *o)
{
    return o->live && !o->mc_joined;
}

/* Refused before anything changes: a bind or map still waiting for its
 * team, or an object that cannot be rebuilt. */
static enum phase_result refuse_busy(struct reply *r, const char *op, bool check_supported)
{
    uint32_t busy, bad;

    pthread_mutex_lock(&g.lock);
    busy = calls_in_flight;
    bad = check_supported ? multicast_unsupported() : 0;
    pthread_mutex_unlock(&g.lock);
    if (busy) {
        reply_msg(r, CUIP_STATUS_REFUSED,
                  "%s: %u multicast bind(s) or map(s) of the application are still waiting "
                  "for their team",
                  op, busy);
        return PHASE_REFUSED;
    }
    if (bad) {
        reply_msg(r, CUIP_STATUS_REFUSED,
                  "%s: %u multicast object(s) exportable through a handle type other than "
                  "POSIX FD cannot be rebuilt",
                  op, bad);
        return PHASE_REFUSED;
    }
    return PHASE_DONE;
}

enum phase_result multicast_prepare(struct reply *r)
{
    enum phase_result rc = refuse_busy(r, "PREPARE_MULTICAST", true);
    return rc != PHASE_DONE ? rc : each_object(r, "PREPARE_MULTICAST", any, teardown);
}

enum phase_result multicast_restore_creators(struct reply *r)
{
    return each_object(r, "RESTORE_MULTICAST_CREATORS", dead_creator, create);
}

enum phase_result multicast_restore_importers(struct reply *r)
{
    return each_object(r, "RESTORE_MULTICAST_IMPORTERS", dead_import, import);
}

enum phase_result multicast_restore_devices(struct reply *r)
{
    return each_object(r, "RESTORE_MULTICAST_DEVICES", not_joined, join);
}

enum phase_result multicast_restore_bindings(struct reply *r)
{
    return each_object(r, "RESTORE_MULTICAST_BINDINGS", any, bind_and_map);
}

enum phase_result multicast_rollback_ready(struct reply *r)
{
    return refuse_busy(r, "ROLLBACK_ALLOCATIONS", false);
}

/* Every team is rebuilt from scratch, whatever phase this process stopped
 * in: a creator's new object means that no importer may keep the old one. */
enum phase_result multicast_rollback_create(struct reply *r)
{
    enum phase_result rc = each_object(r, "ROLLBACK_ALLOCATIONS", any, teardown);

    if (rc == PHASE_DONE)
        rc = each_object(r, "ROLLBACK_ALLOCATIONS", dead_creator, create);
    return rc;
}

enum phase_result multicast_rollback_rebuild(struct reply *r)
{
    enum phase_result rc = each_object(r, "ROLLBACK_IMPORTS", dead_import, import);

    if (rc == PHASE_DONE)
        rc = each_object(r, "ROLLBACK_IMPORTS", not_joined, join);
    if (rc == PHASE_DONE)
        rc = each_object(r, "ROLLBACK_IMPORTS", any, bind_and_map);
    return rc;
}
