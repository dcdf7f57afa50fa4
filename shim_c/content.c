/*
 * Allocation content: SAVE_ALLOCATIONS and LOAD_ALLOCATIONS.
 *
 * A process copies every allocation it created (obj_staged: shared or
 * private, unless SNAPSHOT_SHIM_STAGE_PRIVATE=0) to host memory, so that
 * the native checkpoint moves only what the shim does not own: it copied
 * private memory at 1.7-2 GB/s on the H200 (issue 19), the staging pool at
 * up to 50. The copy goes through the application's read-write mapping of
 * the whole allocation, else a temporary one (the application's own
 * mappings may be partial or read-only). LOAD re-creates each allocation with its original
 * properties, maps it at its original VAs with its access, copies the bytes
 * back and drops the host copy. ROLLBACK_ALLOCATIONS does the same but keeps
 * the host copies (ROLLBACK_IMPORTS frees them once every importer has
 * imported again). An allocation that fails to load is left as it was
 * (torn down, its bytes staged); out of device memory, the op answers
 * RETRY. Runs on the control thread without g.lock: outside ACTIVE the
 * application cannot change the tables.
 *
 * LOAD's re-creations run on SNAPSHOT_SHIM_LOAD_CREATE_THREADS creator
 * threads (creators.c), claimed in slot order, while the control thread
 * queues each allocation's copy as soon as it exists, in the same order (so
 * that neighbours in host memory still share chunks) and the pool copies.
 * On the H200 the three calls took ~62 us per allocation on the control
 * thread, longer than the copy of a 2 MiB allocation (~38 us at 55 GB/s):
 * 2048 x 2 MiB spent 127 ms creating against ~78 ms of copy and ran at 0.52
 * of the HtoD ceiling. Threads rather than one cuMemSetAccess per run of
 * contiguous mappings: the driver's VMM calls are documented thread-safe,
 * while one access call across mappings of separate reservations is not
 * known to be allowed, and every allocation keeps its own calls (so its own
 * failure and undo). Whether threads help is the driver's to say, and the
 * one H200 figure says no: 8 creator threads (this same shape, removed in
 * 577dc86) took 0.197 s of setup against 0.142 s on the control thread, and
 * tripled the copy threads' time (the driver serializes these calls, and
 * 8 creators beside 16 copy threads oversubscribed 16 CPUs). So 0 by
 * default (the control thread, as before), and the setting to sweep 1, 2
 * and 4 on the H200 (bench/run_load_create_h200.sh). Each creation touches
 * only its own object (its handle under g.lock, its recorded mappings, its
 * item), so creations need no order between them; the control thread
 * alone touches the queue.
 *
 * SNAPSHOT_SHIM_LOAD_ACCESS_RUNS=1 (off by default) cuts the calls instead:
 * an allocation with one mapping, the application's read-write one of all
 * of it, is mapped without its access (deferred), and the control thread
 * sets the access of a run of such mappings side by side (one context, the
 * same descriptors, at most RUN_MAX and a copy chunk) in one call before
 * queueing their copies. The driver documents one call over several
 * mappings of one reservation (torch's expandable segments map that way);
 * over reservations side by side (what 2048 separate cuMemAddressReserve
 * calls may give) it is not known, so it stays off until bench/vmm_probe.py
 * says so on the H200. A failed run undoes all its allocations.
 *
 * The bytes move through the staging engine (staging.c: one worker pool per
 * op, one queue of chunks across all allocations, huge-page staging memory;
 * its header says why). Here: which allocations move, where their host
 * slices lie, which device VA each copy uses, and the per-allocation
 * semantics of failure.
 *
 * Resident staging memory (SNAPSHOT_SHIM_STAGING_RESIDENT_MIB, off by
 * default): the first touch of fresh staging memory was the largest item of
 * a big SAVE on the H200 (8 GiB: 2.7 thread-s of 16 threads' ~5.5 in a
 * 0.34 s op, docs/benchmarks.md), and LOAD paid again to give it back. With
 * the setting, a SAVE of at most that many bytes keeps its mapping after
 * LOAD (populated, unpinned) and the next SAVE copies into it without
 * faulting a page (measured: 8 GiB SAVE 0.185 s against 0.45 s, LOAD
 * 0.19 s against 0.27 s); the price is that much host memory held while the
 * application runs. Only a mapping that no allocation's staged bytes still
 * use is reused; a larger SAVE replaces it; a forked child drops its copy.
 *
 * Pinned memory: SNAPSHOT_SHIM_STAGING_BOUNCE_MIB (8) per staging thread plus
 * one for the control thread, pinned on first use and kept for the life of
 * the process (128 MiB at 16 threads; SNAPSHOT_SHIM_STAGING_BOUNCE_KEEP=0:
 * freed by every LOAD); with 0, at most threads x chunk of the staging
 * memory is registered at any moment, only during an op.
 *
 * Host storage: one staging mapping per SAVE (staging_alloc), cut into one
 * slice per allocation in slot order; each slice is o->host (o->host_len
 * bytes) and is unmapped on its own. Host memory used: the sum of the saved
 * allocations' sizes (page-rounded), from SAVE until LOAD (or until
 * ROLLBACK_IMPORTS).
 *
 * The device side of a copy: the application's own mapping when one covers
 * the whole allocation with read-write access for its device (the common
 * case: no driver call at all), else a temporary read-write mapping of the
 * whole allocation (the application's may be read-only, or for another
 * device).
 *
 * SNAPSHOT_SHIM_TIMING=1 writes, per op, one line "cuinterpose-timing {...}"
 * to stderr: where the op's time went (setup, pool start, population,
 * registration, copy, unregistration, release, teardown).
 */
#include "shim.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MSG_LEN 512

/* The resident staging mapping; p is NULL when there is none. Touched by
 * the control thread only (ops run there, one at a time). */
static struct {
    char *p;
    size_t len;
    pid_t pid;
} resident;

/* One op's figures (nanoseconds of wall time unless the staging's). */
struct stats {
    bool resident;              /* SAVE: into the resident mapping, already populated */
    uint64_t count, bytes;
    uint64_t setup_ns;          /* the control thread producing work (SAVE: maps; LOAD:
                                 * queueing each copy as its allocation exists) */
    uint64_t drain_ns;          /* waiting for the queue after the last item */
    uint64_t teardown_ns;       /* temporary unmaps, release of staged bytes, munmaps */
    uint64_t create_ns;         /* LOAD: re-creation, summed over the creator threads */
    unsigned create_threads;    /* LOAD: creator threads started */
    uint64_t access_runs;       /* LOAD: cuMemSetAccess calls made for runs */
    struct staging_times st;
};

/* One allocation of the op: its copy's device VA, temporary or not. */
struct item {
    struct obj *o;
    CUdeviceptr va;
    bool temp;                  /* va is a temporary mapping: unmap after the copy */
    CUmemGenericAllocationHandle h; /* LOAD: the re-created handle */
    /* LOAD, written by the creator thread before the item settles
     * (creators.c's lock orders it before the control thread's read): */
    bool retry;                 /* its creation failed out of memory, cleanly undone */
    char *why;                  /* its creation's failure, malloc'd */
    bool queued;                /* LOAD: its copy is queued (control thread only) */
    bool deferred;              /* LOAD: mapped without access, set by its run's call */
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

/* ------------------------------------------------------------ phases */

/* Whether `p` lies in the resident mapping (which outlives its slices). */
static bool in_resident(const char *p)
{
    return resident.p && resident.pid == getpid() && p >= resident.p &&
           p < resident.p + resident.len;
}

static void unmap_host(struct obj *o)
{
    if (in_resident(o->host))
        ; /* kept for the next SAVE */
    else if (munmap(o->host, o->host_len) != 0)
        shim_log(LOG_WARN, "munmap of a saved copy failed: %s", strerror(errno));
    o->host = NULL;
    o->host_len = 0;
}

static void free_hosts(void)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (o && o->host)
            unmap_host(o);
    }
}

/* A message naming the allocation (32 hex digits and its size). */
static void name_allocation(char *msg, size_t n, const struct obj *o)
{
    char id[2 * CUIP_ID_LEN + 1];
    size_t used = strnlen(msg, n);
    shim_hex(id, o->id, CUIP_ID_LEN);
    id[2 * CUIP_ID_LEN] = 0;
    if (used < n)
        snprintf(msg + used, n - used, " (allocation %s, %llu bytes)", id,
                 (unsigned long long)o->size);
}

/* A message naming the allocation and where it lives (a LOAD's failure). */
static void name_creation(char *msg, size_t n, const struct obj *o)
{
    char id[2 * CUIP_ID_LEN + 1];
    size_t used = strnlen(msg, n);
    shim_hex(id, o->id, CUIP_ID_LEN);
    id[2 * CUIP_ID_LEN] = 0;
    if (used >= n)
        return;
    if (o->prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        snprintf(msg + used, n - used, " (allocation %s, %llu bytes, device %d)", id,
                 (unsigned long long)o->size, o->prop.location.id);
    else
        snprintf(msg + used, n - used, " (allocation %s, %llu bytes, location type %d id %d)",
                 id, (unsigned long long)o->size, (int)o->prop.location.type,
                 o->prop.location.id);
}

/* The application's mapping of all of `o` that its device may read and
 * write, or 0. Call with o->ctx current. */
static CUdeviceptr own_mapping(const struct obj *o)
{
    CUdevice dev = access_device(o);
    for (uint32_t k = 0; k < o->nmaps; k++) {
        const struct mapping *m = &o->maps[k];
        if (m->offset != 0 || m->size != o->size)
            continue;
        for (uint32_t a = 0; a < m->access_count; a++)
            if (m->access[a].location_type == CU_MEM_LOCATION_TYPE_DEVICE &&
                m->access[a].location_id == dev &&
                m->access[a].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                return m->va;
    }
    return 0;
}

/* it->va: the application's mapping, or a temporary one of `h`. */
static int pick_va(struct item *it, CUmemGenericAllocationHandle h, char *msg, size_t n)
{
    it->va = own_mapping(it->o);
    it->temp = it->va == 0;
    if (it->temp && temp_map(it->o, h, &it->va, msg, n) != 0) {
        it->temp = false;
        return -1;
    }
    return 0;
}

/* Undo pick_va; 0 or -1 and msg. */
static int drop_va(struct item *it, char *msg, size_t n)
{
    bool pushed;
    int rc = 0;

    if (!it->temp)
        return 0;
    if (shim_ctx_enter(it->o->ctx, &pushed) != CUDA_SUCCESS)
        pushed = false; /* the unmap names its own failure */
    rc = temp_unmap(it->o, it->va, msg, n);
    shim_ctx_leave(pushed);
    it->temp = false;
    return rc;
}

/* Count what moves and start the progress counter; items array for it. */
static uint32_t phase_items(bool saving, struct item **items, uint64_t *total)
{
    uint32_t count = 0;
    *total = 0;
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!obj_staged(o) || (saving ? !o->live || o->host : o->live))
            continue;
        count++;
        *total += o->size;
    }
    __atomic_store_n(&g.phase_bytes_total, *total, __ATOMIC_RELAXED);
    __atomic_store_n(&g.phase_bytes_done, 0, __ATOMIC_RELAXED);
    *items = count ? calloc(count, sizeof **items) : NULL;
    return count;
}

static const char *populate_name(enum staging_populate how)
{
    switch (how) {
    case STAGING_POPULATE_MADVISE:
        return "madvise";
    case STAGING_POPULATE_TOUCH:
        return "touch";
    case STAGING_POPULATE_NONE:
        break;
    }
    return "none";
}

/* A finished op's figures: logged, in the reply, and with
 * SNAPSHOT_SHIM_TIMING=1 as one JSON line on stderr. */
static void report_done(struct reply *r, const char *op, const struct stats *st, uint64_t t0)
{
    const struct shim_settings *cfg = shim_settings();
    uint64_t ns = shim_now_ns() - t0;
    const struct staging_times *t = &st->st;

    shim_log(LOG_INFO,
             "%s: %llu allocations, %llu bytes, %llu chunks of %zu MiB (at most %zu) on %u of "
             "%u threads, %.2f GB/s end to end, copy %.3f s",
             op, (unsigned long long)st->count, (unsigned long long)st->bytes,
             (unsigned long long)t->chunks, t->chunk >> 20, cfg->copy_chunk >> 20, t->threads,
             cfg->copy_threads, ns ? (double)st->bytes / (double)ns : 0.0,
             (double)t->copy_wall_ns / 1e9);
    r->h.stat_count = st->count;
    r->h.stat_bytes = st->bytes;
    r->h.stat_copy_ns = t->copy_wall_ns;
    if (cfg->timing) {
        char line[1536];
        int m = snprintf(
            line, sizeof line,
            "cuinterpose-timing {\"pid\": %d, \"op\": \"%s\", \"allocations\": %llu, "
            "\"bytes\": %llu, \"threads\": %u, \"chunk\": %zu, \"chunks\": %llu, "
            "\"thp\": %s, \"bounce\": %zu, \"bounce_pin\": \"%s\", \"bounce_keep\": %s, "
            "\"depth\": %u, \"populate_threads\": %u, \"populate_method\": \"%s\", "
            "\"populated_ahead\": %llu, "
            "\"chunks_per_thread\": %u, \"resident\": %s, \"create_threads\": %u, "
            "\"access_runs\": %llu, "
            "\"elapsed_s\": %.6f, \"setup_s\": %.6f, "
            "\"pool_start_s\": %.6f, \"drain_s\": %.6f, \"teardown_s\": %.6f, "
            "\"copy_wall_s\": %.6f, "
            "\"thread_s\": {\"populate\": %.6f, \"register\": %.6f, \"copy\": %.6f, "
            "\"unregister\": %.6f, \"release\": %.6f, \"memcpy\": %.6f, "
            "\"create\": %.6f}}\n",
            (int)getpid(), op, (unsigned long long)st->count, (unsigned long long)st->bytes,
            t->threads, t->chunk, (unsigned long long)t->chunks,
            cfg->staging_thp ? "true" : "false", cfg->staging_bounce,
            cfg->staging_bounce_register ? "register" : "alloc",
            cfg->staging_bounce_keep ? "true" : "false", cfg->staging_depth,
            cfg->staging_ahead, populate_name(t->populate_how),
            (unsigned long long)t->populated_chunks, cfg->staging_spread, st->resident ? "true" : "false",
            st->create_threads, (unsigned long long)st->access_runs,
            (double)ns / 1e9, (double)st->setup_ns / 1e9, (double)t->pool_start_ns / 1e9,
            (double)st->drain_ns / 1e9, (double)st->teardown_ns / 1e9,
            (double)t->copy_wall_ns / 1e9, (double)t->populate_ns / 1e9,
            (double)t->register_ns / 1e9, (double)t->copy_ns / 1e9,
            (double)t->unregister_ns / 1e9, (double)t->release_ns / 1e9,
            (double)t->memcpy_ns / 1e9, (double)st->create_ns / 1e9);
        if (m > 0 && (size_t)m < sizeof line)
            shim_write_line(line, (size_t)m);
    }
}

/* Whether any allocation's staged bytes still lie in the resident mapping. */
static bool resident_in_use(void)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        const struct obj *o = obj_at(i);
        if (o && o->host && in_resident(o->host))
            return true;
    }
    return false;
}

/* Staging memory for a SAVE of `len` bytes: the resident mapping when the
 * setting allows `len` and none of it is in use (`*populated`: no page to
 * fault), else a fresh mapping, kept as the resident one when the setting
 * allows. NULL and msg on failure. */
static char *arena_get(size_t len, bool *populated, char *msg, size_t n)
{
    size_t bound = shim_settings()->staging_resident;
    char *p;

    *populated = false;
    if (resident.p && resident.pid != getpid()) {
        /* A fork child's copy of its parent's: its own to drop. */
        munmap(resident.p, resident.len);
        resident.p = NULL;
    }
    if (len > bound || (resident.p && resident_in_use()))
        return staging_alloc(len, msg, n);
    if (resident.p && resident.len >= len) {
        *populated = true;
        return resident.p;
    }
    if (resident.p) {
        munmap(resident.p, resident.len);
        resident.p = NULL;
    }
    p = staging_alloc(len, msg, n);
    if (p) {
        resident.p = p;
        resident.len = len;
        resident.pid = getpid();
    }
    return p;
}

/* Undo arena_get after a failed SAVE: the resident mapping stays. */
static void arena_put(char *arena, size_t len)
{
    if (arena != resident.p && munmap(arena, len) != 0)
        shim_log(LOG_WARN, "munmap of staging memory failed: %s", strerror(errno));
}

/* The items' host slices in one staging mapping, queued as their VAs are
 * ready. On failure nothing is kept: no o->host is set, the mapping is
 * gone, every temporary mapping undone. */
static int save_items(struct item *items, uint32_t count, uint64_t total, struct stats *st,
                      char *msg, size_t n)
{
    size_t len = 0, off = 0;
    char *arena;
    struct staging *s;
    uint32_t queued = 0;
    int rc = 0;
    uint64_t t0, t1;
    char ignored[8];

    for (uint32_t i = 0; i < count; i++)
        len += staging_len(items[i].o->size);
    arena = arena_get(len, &st->resident, msg, n);
    if (!arena)
        return -1;
    s = staging_start(true, st->resident, total, count, msg, n);
    if (!s) {
        arena_put(arena, len);
        return -1;
    }
    t0 = shim_now_ns();
    for (; queued < count && rc == 0; queued++) {
        struct item *it = &items[queued];
        bool pushed;
        CUresult r = shim_ctx_enter(it->o->ctx, &pushed);
        if (r != CUDA_SUCCESS) {
            shim_fail(msg, n, "cuCtxPushCurrent", r);
            rc = -1;
            break;
        }
        rc = pick_va(it, it->o->real, msg, n);
        shim_ctx_leave(pushed);
        if (rc == 0 && staging_add(s, it->o, arena + off, it->va, it->o->ctx) != 0) {
            snprintf(msg, n, "the staging queue is full (an internal bound is wrong)");
            rc = -1;
        }
        if (rc != 0)
            name_allocation(msg, n, it->o);
        off += staging_len(it->o->size);
    }
    t1 = shim_now_ns();
    st->setup_ns = t1 - t0;
    if (staging_wait(s, rc == 0 ? msg : ignored, rc == 0 ? n : sizeof ignored) != 0)
        rc = -1;
    staging_stop(s, &st->st);
    t0 = shim_now_ns();
    st->drain_ns = t0 - t1;
    for (uint32_t i = 0; i < queued; i++)
        if (drop_va(&items[i], rc == 0 ? msg : ignored, rc == 0 ? n : sizeof ignored) != 0)
            rc = -1;
    if (rc != 0) {
        arena_put(arena, len);
        st->teardown_ns = shim_now_ns() - t0;
        return -1;
    }
    off = 0;
    for (uint32_t i = 0; i < count; i++) {
        struct obj *o = items[i].o;
        o->host = arena + off;
        o->host_len = staging_len(o->size);
        off += o->host_len;
        st->count++;
        st->bytes += o->size;
    }
    st->teardown_ns = shim_now_ns() - t0;
    return 0;
}

enum phase_result content_save(struct reply *r)
{
    struct stats st;
    struct item *items = NULL;
    uint64_t total, t0 = shim_now_ns();
    uint32_t count, k = 0;
    char msg[MSG_LEN];

    memset(&st, 0, sizeof st);
    if (shim_settings()->native_content)
        return PHASE_DONE; /* the native checkpoint moves the bytes */
    count = phase_items(true, &items, &total);
    if (count && !items) {
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "SAVE_ALLOCATIONS: out of memory for %u items",
                  count);
        return PHASE_FAILED;
    }
    for (uint32_t i = 0; i < obj_count() && k < count; i++) {
        struct obj *o = obj_at(i);
        if (obj_staged(o) && o->live && !o->host)
            items[k++].o = o;
    }
    /* Nothing is torn down before PREPARE_UNICAST: all stay live. */
    if (count && save_items(items, count, total, &st, msg, sizeof msg) != 0) {
        free(items);
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "SAVE_ALLOCATIONS: %s", msg);
        return PHASE_FAILED;
    }
    free(items);
    report_done(r, "SAVE_ALLOCATIONS", &st, t0);
    return PHASE_DONE;
}

/* The one mapping of `o`, without its access (set by its run: load_items). */
static CUresult map_only(const struct obj *o, char *msg, size_t n)
{
    const struct mapping *m = &o->maps[0];
    CUresult r = real.cuMemMap(m->va, m->size, m->offset, o->real, m->flags);

    if (r != CUDA_SUCCESS)
        shim_fail(msg, n, "cuMemMap", r);
    return r;
}

/* Re-create `it->o` with its recorded properties and map it at its
 * recorded VAs, and pick the copy's VA. On failure the allocation's own
 * partial work is undone: no handle, no mapping, not live, its staged bytes
 * kept; `*retry` says the driver was out of memory and the undo was clean.
 * Called with it->o->ctx current. */
static int create_one(struct item *it, bool *retry, char *msg, size_t n)
{
    struct obj *o = it->o;
    CUmemGenericAllocationHandle h = 0;
    char ignored[8];
    CUresult r = real.cuMemCreate(&h, o->size, &o->prop, 0);

    *retry = false;
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemCreate", r);
        *retry = r == CUDA_ERROR_OUT_OF_MEMORY;
        return -1;
    }
    if (SHIM_IS_TAGGED(h)) {
        snprintf(msg, n, "cuMemCreate: driver handle collides with the shim's tag range");
        goto fail_h;
    }
    pthread_mutex_lock(&g.lock); /* readers check `live` first, but keep it clean */
    o->real = h;
    pthread_mutex_unlock(&g.lock);
    it->deferred = shim_settings()->load_access_runs && o->nmaps == 1 &&
                   o->maps[0].access_count > 0 && own_mapping(o) != 0;
    /* Undoes its own partial work; a deferred mapping's access is its run's. */
    r = it->deferred ? map_only(o, msg, n) : unicast_load_mappings(o, msg, n);
    if (r != CUDA_SUCCESS) {
        *retry = r == CUDA_ERROR_OUT_OF_MEMORY;
        goto fail_h;
    }
    if (pick_va(it, h, msg, n) != 0)
        goto fail_maps;
    it->h = h;
    return 0;
fail_maps:
    if (unicast_unload_mappings(o, ignored, sizeof ignored) != 0)
        *retry = false;
fail_h:
    r = real.cuMemRelease(h);
    if (r != CUDA_SUCCESS) {
        shim_log(LOG_WARN, "cuMemRelease of a failed re-creation failed: %s", shim_cu_name(r));
        *retry = false;
    }
    pthread_mutex_lock(&g.lock);
    o->real = 0;
    pthread_mutex_unlock(&g.lock);
    return -1;
}

/* Undo create_one after its copy failed: not live, no mapping, no handle;
 * the staged bytes stay. */
static void uncreate(struct item *it)
{
    char ignored[8];
    bool pushed;
    CUresult r;

    if (shim_ctx_enter(it->o->ctx, &pushed) != CUDA_SUCCESS)
        pushed = false;
    unicast_unload_mappings(it->o, ignored, sizeof ignored);
    r = real.cuMemRelease(it->h);
    if (r != CUDA_SUCCESS)
        shim_log(LOG_WARN, "cuMemRelease of a failed re-creation failed: %s", shim_cu_name(r));
    shim_ctx_leave(pushed);
    pthread_mutex_lock(&g.lock);
    it->o->real = 0;
    pthread_mutex_unlock(&g.lock);
}

/* One LOAD's re-creations, shared with the creator threads. */
struct load_job {
    struct item *items;
    uint64_t create_ns;         /* atomic: thread time spent re-creating */
};

/* Re-create item i (creators.c: on a creator thread, or on the control
 * thread with SNAPSHOT_SHIM_LOAD_CREATE_THREADS=0). Every item is its own:
 * its obj, its recorded VAs and its reservations are no other item's, so the
 * creations of different items need no order between them (the driver's
 * VMM calls are thread-safe; the simulator's take its one lock). On failure
 * its own partial work is undone (create_one) and its message, naming the
 * allocation and its device, kept in it->why for the control thread. */
static int create_job(void *arg, uint32_t i)
{
    struct load_job *job = arg;
    struct item *it = &job->items[i];
    char msg[MSG_LEN];
    uint64_t t0 = shim_now_ns();
    bool pushed;
    int rc = -1;
    CUresult r = shim_ctx_enter(it->o->ctx, &pushed);

    it->retry = false;
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, sizeof msg, "cuCtxPushCurrent", r);
    } else {
        rc = create_one(it, &it->retry, msg, sizeof msg);
        shim_ctx_leave(pushed);
    }
    __atomic_fetch_add(&job->create_ns, shim_now_ns() - t0, __ATOMIC_RELAXED);
    if (rc == 0)
        return 0;
    name_creation(msg, sizeof msg, it->o);
    it->why = strdup(msg); /* NULL: named as lost by note_failure */
    return -1;
}

/* The failures of one LOAD's creations, in item order. */
struct failures {
    uint32_t count;
    bool hard;                  /* the one named may not be retried */
};

/* Keep the message of the first failure that may not be retried, else of
 * the first: RETRY only when every failure was out of memory and undone. */
static void note_failure(struct failures *f, bool retry, const char *why, char *msg, size_t n)
{
    if (f->count++ == 0 || (!f->hard && !retry)) {
        snprintf(msg, n, "%s", why ? why : "an allocation failed to load (its message was "
                                           "lost: out of memory)");
        f->hard = !retry;
    }
}

/* At most this many allocations share one access call (and they span at
 * most a copy chunk, so that their copies start as soon as a chunk's worth
 * is mapped). */
#define RUN_MAX 64

/* Deferred items (SNAPSHOT_SHIM_LOAD_ACCESS_RUNS) whose mappings lie side by
 * side, in one context, with the same access: one cuMemSetAccess for all. */
struct run {
    uint32_t idx[RUN_MAX];
    uint32_t count;
    CUdeviceptr va;
    size_t len;
};

/* The control thread's queueing of one LOAD's copies. */
struct queueing {
    struct staging *s;
    struct creators *c;
    struct item *items;
    struct failures f;
    bool full;                  /* the queue refused one: nothing more is queued */
    struct run run;
    uint64_t access_runs;
    char *msg;
    size_t n;
};

static bool same_access(const struct mapping *a, const struct mapping *b)
{
    return a->access_count == b->access_count &&
           memcmp(a->access, b->access, a->access_count * sizeof a->access[0]) == 0;
}

/* Whether deferred `it` extends the open run. */
static bool run_extends(const struct queueing *q, const struct item *it)
{
    const struct run *run = &q->run;
    const struct mapping *m = &it->o->maps[0];
    const struct obj *first;

    if (run->count == 0 || run->count == RUN_MAX)
        return false;
    first = q->items[run->idx[0]].o;
    return it->o->ctx == first->ctx && run->va + run->len == m->va &&
           run->len + m->size <= shim_settings()->copy_chunk && same_access(m, &first->maps[0]);
}

/* Queue `it`'s copy; once the queue refused one (cannot happen: its bound),
 * `it` is undone instead, and the first refusal noted. */
static void queue_one(struct queueing *q, struct item *it)
{
    char ignored[8], why[MSG_LEN];

    if (!q->full && staging_add(q->s, it->o, it->o->host, it->va, it->o->ctx) == 0) {
        it->queued = true;
        return;
    }
    if (!q->full) {
        q->full = true;
        creators_cancel(q->c);
        snprintf(why, sizeof why, "the staging queue is full (an internal bound is wrong)");
        name_allocation(why, sizeof why, it->o);
        note_failure(&q->f, false, why, q->msg, q->n);
    }
    drop_va(it, ignored, sizeof ignored);
    uncreate(it);
}

/* The open run's access, in one call; `*call` names the one that failed. */
static CUresult run_access(const struct queueing *q, const char **call)
{
    const struct obj *o = q->items[q->run.idx[0]].o;
    const struct mapping *m = &o->maps[0];
    CUmemAccessDesc d[CUIP_ACCESS_MAX];
    bool pushed;
    CUresult r = shim_ctx_enter(o->ctx, &pushed);

    if (r != CUDA_SUCCESS) {
        *call = "cuCtxPushCurrent";
        return r;
    }
    memset(d, 0, sizeof d);
    for (uint32_t i = 0; i < m->access_count; i++) {
        d[i].location.type = (CUmemLocationType)m->access[i].location_type;
        d[i].location.id = m->access[i].location_id;
        d[i].flags = (CUmemAccess_flags)m->access[i].flags;
    }
    *call = "cuMemSetAccess";
    r = real.cuMemSetAccess(q->run.va, q->run.len, d, m->access_count);
    shim_ctx_leave(pushed);
    return r;
}

/* Set the open run's access and queue its items; if that fails, every item
 * of the run is undone (no handle, no mapping) and noted, naming the call,
 * the run and its first allocation (not retried: FAILED, then a rollback). */
static void flush_run(struct queueing *q)
{
    struct run *run = &q->run;
    const char *call = "cuMemSetAccess";
    char why[MSG_LEN];
    CUresult r;

    if (run->count == 0)
        return;
    r = run_access(q, &call);
    q->access_runs++;
    if (r == CUDA_SUCCESS) {
        for (uint32_t k = 0; k < run->count; k++)
            queue_one(q, &q->items[run->idx[k]]);
        run->count = 0;
        return;
    }
    snprintf(why, sizeof why,
             "%s failed: %s (%d) for %u mappings side by side at 0x%llx (%zu bytes), the first",
             call, shim_cu_name(r), (int)r, run->count, (unsigned long long)run->va, run->len);
    name_creation(why, sizeof why, q->items[run->idx[0]].o);
    creators_cancel(q->c);
    for (uint32_t k = 0; k < run->count; k++) {
        note_failure(&q->f, false, why, q->msg, q->n);
        uncreate(&q->items[run->idx[k]]);
    }
    run->count = 0;
}

/* Add deferred `it` (item i) to the open run, or to a new one. */
static void run_add(struct queueing *q, struct item *it, uint32_t i)
{
    const struct mapping *m = &it->o->maps[0];

    if (!run_extends(q, it)) {
        flush_run(q);
        q->run.va = m->va;
        q->run.len = 0;
    }
    q->run.idx[q->run.count++] = i;
    q->run.len += m->size;
}

/* Take the re-created items in order and queue each one's copy (a deferred
 * one once its run's access is set); a failed one is noted and skipped, as
 * are those never started after it. One that the queue refuses (cannot
 * happen: its bound) stops the queueing: it and the ones re-created after
 * it are undone. 0, else -1, msg and *retry. */
static int queue_created(struct staging *s, struct creators *c, struct item *items,
                         uint32_t count, struct stats *st, bool *retry, char *msg, size_t n)
{
    struct queueing q;

    memset(&q, 0, sizeof q);
    q.s = s;
    q.c = c;
    q.items = items;
    q.msg = msg;
    q.n = n;
    for (uint32_t i = 0; i < count; i++) {
        struct item *it = &items[i];
        enum create_state cs = creators_wait(c, i);

        if (cs == CREATE_DONE && it->deferred && !q.full) {
            run_add(&q, it, i);
            continue;
        }
        flush_run(&q); /* the earlier items first: host order */
        if (cs == CREATE_DONE)
            queue_one(&q, it);
        else if (cs == CREATE_FAILED)
            note_failure(&q.f, it->retry, it->why, msg, n);
        free(it->why);
        it->why = NULL;
    }
    flush_run(&q);
    st->access_runs = q.access_runs;
    if (q.f.count > 1) {
        size_t used = strnlen(msg, n);
        snprintf(msg + used, n - used, "; %u allocations failed to load", q.f.count);
    }
    *retry = q.f.count > 0 && !q.f.hard;
    return q.f.count ? -1 : 0;
}

/* Undo every queued item of a LOAD whose copy failed. */
static void uncreate_queued(struct item *items, uint32_t count)
{
    for (uint32_t i = 0; i < count; i++)
        if (items[i].queued)
            uncreate(&items[i]);
}

/* The queued items loaded: staged bytes given back unless `keep`, live. */
static void finish_queued(struct staging *s, struct item *items, uint32_t count, bool keep,
                          struct stats *st)
{
    char ignored[8];

    if (!keep) {
        for (uint32_t i = 0; i < count; i++)
            if (items[i].queued && !in_resident(items[i].o->host))
                staging_release(s, items[i].o->host, items[i].o->host_len);
        staging_wait(s, ignored, sizeof ignored);
    }
    staging_stop(s, &st->st);
    for (uint32_t i = 0; i < count; i++) {
        struct obj *o = items[i].o;
        if (!items[i].queued)
            continue;
        if (!keep)
            unmap_host(o);
        st->count++;
        st->bytes += o->size;
        pthread_mutex_lock(&g.lock);
        o->live = true;
        pthread_mutex_unlock(&g.lock);
    }
}

/* Load `items` (not live, bytes staged): re-created by the creator threads
 * in order, each one's copy queued by the control thread as soon as it
 * exists while the pool copies the earlier ones, then the copied ones made
 * live. A creation that fails stops the claiming of more: the ones already
 * re-created still finish (and stay live), the failed ones are undone
 * (*retry: all of them out of memory). A failed copy undoes every item of
 * the op (FAILED). Staged bytes are given back only when `!keep` and the
 * item is live. */
static int load_items(struct item *items, uint32_t count, uint64_t total, bool keep,
                      struct stats *st, bool *retry, char *msg, size_t n)
{
    struct staging *s = staging_start(false, false, total, count, msg, n);
    struct load_job job = {items, 0};
    struct creators *c;
    int produce_rc, copy_rc;
    uint64_t t0 = shim_now_ns(), t1;
    char copy_msg[MSG_LEN];

    *retry = false;
    if (!s)
        return -1;
    c = creators_start(count, shim_settings()->load_create_threads, create_job, &job);
    if (!c) {
        staging_stop(s, NULL);
        snprintf(msg, n, "out of memory for the creator threads (%u allocations)", count);
        return -1;
    }
    st->create_threads = creators_threads(c);
    produce_rc = queue_created(s, c, items, count, st, retry, msg, n);
    creators_stop(c);
    st->create_ns = __atomic_load_n(&job.create_ns, __ATOMIC_RELAXED);
    t1 = shim_now_ns();
    copy_msg[0] = 0;
    copy_rc = staging_wait(s, copy_msg, sizeof copy_msg);
    st->setup_ns = t1 - t0;
    st->drain_ns = shim_now_ns() - t1;
    t0 = shim_now_ns();
    for (uint32_t i = 0; i < count; i++)
        if (items[i].queued && drop_va(&items[i], copy_msg, sizeof copy_msg) != 0)
            copy_rc = -1;
    if (copy_rc != 0) {
        uncreate_queued(items, count);
        staging_stop(s, &st->st);
        snprintf(msg, n, "%s", copy_msg);
        *retry = false;
        st->teardown_ns = shim_now_ns() - t0;
        return -1;
    }
    finish_queued(s, items, count, keep, st);
    st->teardown_ns = shim_now_ns() - t0;
    return produce_rc;
}

/* Every creator-owned shared allocation that is not live, loaded again from
 * its staged bytes; live ones are skipped, so the op is idempotent and a
 * retry after RETRY finishes the rest. */
static enum phase_result load_all(struct reply *r, const char *op, bool keep)
{
    struct stats st;
    struct item *items = NULL;
    uint64_t total, t0 = shim_now_ns();
    uint32_t count, k = 0;
    char msg[MSG_LEN];
    bool retry = false;

    memset(&st, 0, sizeof st);
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!obj_staged(o) || o->live || o->host)
            continue;
        msg[0] = 0;
        name_allocation(msg, sizeof msg, o);
        if (o->stored) { /* nothing changed: the file holds them (stored.c) */
            reply_msg(r, CUIP_STATUS_REFUSED, "%s: the staged bytes are in the stored files "
                      "(STORE_STAGED); FETCH_STAGED first%s", op, msg);
            return PHASE_REFUSED;
        }
        reply_msg(r, CUIP_STATUS_INTERNAL, "%s: no saved content%s", op, msg);
        return PHASE_FAILED;
    }
    count = phase_items(false, &items, &total);
    if (count && !items) {
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "%s: out of memory for %u items", op, count);
        return PHASE_FAILED;
    }
    for (uint32_t i = 0; i < obj_count() && k < count; i++) {
        struct obj *o = obj_at(i);
        if (obj_staged(o) && !o->live)
            items[k++].o = o;
    }
    if (count && load_items(items, count, total, keep, &st, &retry, msg, sizeof msg) != 0) {
        free(items);
        if (retry) {
            report_done(r, op, &st, t0);
            reply_msg(r, CUIP_STATUS_RETRY, "%s: %s", op, msg);
            return PHASE_RETRY;
        }
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "%s: %s", op, msg);
        return PHASE_FAILED;
    }
    if (count && !keep && !shim_settings()->staging_bounce_keep)
        staging_free_bounces(items[0].o->ctx);
    free(items);
    report_done(r, op, &st, t0);
    return PHASE_DONE;
}

enum phase_result content_load(struct reply *r)
{
    if (shim_settings()->native_content)
        return PHASE_DONE; /* creators kept their allocations */
    return load_all(r, "LOAD_ALLOCATIONS", false);
}

/* ROLLBACK_ALLOCATIONS' content: refused, before anything is done, when a
 * torn-down allocation's staged bytes are gone (nothing to roll back to). */
enum phase_result content_reload(struct reply *r)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        char what[128] = "";
        if (!obj_staged(o) || o->live || o->host)
            continue;
        name_allocation(what, sizeof what, o);
        reply_msg(r, CUIP_STATUS_REFUSED,
                  "ROLLBACK_ALLOCATIONS: the staged bytes of a torn-down allocation are "
                  "%s%s", o->stored ? "in the stored files: FETCH_STAGED first" : "gone", what);
        return PHASE_REFUSED;
    }
    return load_all(r, "ROLLBACK_ALLOCATIONS", true);
}

void content_free_staged(void)
{
    free_hosts();
}

void content_drop_resident(void)
{
    if (!resident.p || resident_in_use())
        return;
    if (resident.pid == getpid() && munmap(resident.p, resident.len) != 0)
        shim_log(LOG_WARN, "munmap of the resident staging memory failed: %s", strerror(errno));
    resident.p = NULL;
    resident.len = 0;
}
