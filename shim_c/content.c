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
#include "keephash.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
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
    /* The kept host copy (keep.c): bytes the op copied and those it found
     * unchanged, whether SAVE compared hashes (enum cuip_hash), and if it
     * could not, why; the hash's wall time. */
    uint64_t bytes_copied, bytes_unchanged;
    uint32_t hash_state;
    char hash_why[256];
    uint64_t hash_ns;
    uint64_t count, bytes;
    uint64_t setup_ns;          /* the control thread producing work: maps, creates */
    uint64_t drain_ns;          /* waiting for the queue after the last item */
    uint64_t teardown_ns;       /* temporary unmaps, release of staged bytes, munmaps */
    /* LOAD: the setup's driver calls, to hold against the driver's bare pace
     * (bench/load_floor.c): cuMemCreate, and cuMemMap with cuMemSetAccess. */
    uint64_t create_ns, map_ns;
    struct staging_times st;
};

/* One allocation of the op: its copy's device VA, temporary or not. */
struct item {
    struct obj *o;
    CUdeviceptr va;
    bool temp;                  /* va is a temporary mapping: unmap after the copy */
    struct keep_copy *kc;       /* SAVE: its pinned kept host copy, else NULL */
    uint64_t *fresh;            /* SAVE: the device bytes' hashes (keep_hash), else NULL */
    CUmemGenericAllocationHandle h; /* LOAD: the re-created handle */
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
    if (o->host_kept || in_resident(o->host))
        ; /* kept for the next SAVE */
    else if (munmap(o->host, o->host_len) != 0)
        shim_log(LOG_WARN, "munmap of a saved copy failed: %s", strerror(errno));
    o->host = NULL;
    o->host_len = 0;
    o->host_kept = false;
}

static void free_hosts(void)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (o && o->host)
            unmap_host(o);
    }
}

/* ------------------------------------------------------------ release after the reply */
/* A LOAD's staged copies, given back to the kernel on a thread of its own
 * once the bytes are on the device, so that the op (and the resume waiting
 * for it) does not wait for the kernel to free the pages: on one H200
 * (2026-12-02, commit c53ba93, docs/benchmarks.md) the teardown was 2.8-5.3
 * ms of a 48-53 ms LOAD of 100 x 20 MiB and 10-29 ms of 128-225 ms for 2048 x 2 MiB inside
 * the op, 0.7-1.5 ms after. No allocation refers to these bytes
 * any more; the ranges are the slices coalesced where they lie back to
 * back. Every op that allocates or reads staging memory settles it first
 * (content_settle), so host memory never holds two phases' copies at once.
 * Used by the thread of the op in flight (g.busy), and at exit under g.lock
 * with none in flight; the job's thread reads nothing else. A
 * fork child drops its parent's without joining (`pid`): the thread is not
 * in the child. */
struct host_range {
    char *p;
    size_t len;
};

static struct releasing {
    pthread_t tid;
    bool running;
    pid_t pid;
    struct host_range *ranges;
    uint32_t count;
    uint64_t bytes;
} releasing;

static void release_ranges(const struct host_range *ranges, uint32_t count)
{
    /* MADV_DONTNEED frees the pages under the mm lock taken for reading, so
     * the application's own page faults go on meanwhile; the munmap that
     * follows has nothing left to free. */
    for (uint32_t i = 0; i < count; i++) {
        if (madvise(ranges[i].p, ranges[i].len, MADV_DONTNEED) != 0)
            shim_log(LOG_WARN, "madvise(MADV_DONTNEED) of staged bytes failed: %s",
                     strerror(errno));
        if (munmap(ranges[i].p, ranges[i].len) != 0)
            shim_log(LOG_WARN, "munmap of a saved copy failed: %s", strerror(errno));
    }
}

/* A test build's hook holds the thread back, so that a test sees the ops that
 * must wait for it wait; nothing in a release build. */
static void release_test_delay(void)
{
#ifdef CUINTERPOSE_TEST_HOOKS
    unsigned delay_ms = shim_settings()->test_release_delay_ms;

    if (delay_ms) {
        struct timespec d = {delay_ms / 1000, (long)(delay_ms % 1000) * 1000000L};
        while (nanosleep(&d, &d) != 0 && errno == EINTR)
            ;
    }
#endif
}

static void *release_main(void *arg)
{
    struct releasing *job = arg;
    uint64_t t0 = shim_now_ns();
    char line[256];
    int m;

    release_test_delay();
    release_ranges(job->ranges, job->count);
    if (!shim_settings()->timing)
        return NULL;
    m = snprintf(line, sizeof line,
                 "cuinterpose-timing {\"pid\": %d, \"op\": \"LOAD_ALLOCATIONS/release\", "
                 "\"bytes\": %llu, \"ranges\": %u, \"elapsed_s\": %.6f}\n",
                 (int)getpid(), (unsigned long long)job->bytes, job->count,
                 (double)(shim_now_ns() - t0) / 1e9);
    if (m > 0 && (size_t)m < sizeof line)
        shim_write_line(line, (size_t)m);
    return NULL;
}

void content_settle(void)
{
    if (!releasing.running)
        return;
    if (releasing.pid == getpid()) {
        int e = pthread_join(releasing.tid, NULL);
        if (e != 0)
            shim_log(LOG_WARN, "joining the thread that frees staged bytes failed: %s",
                     strerror(e));
    }
    free(releasing.ranges);
    memset(&releasing, 0, sizeof releasing);
}

/* At exit, the release still running is waited for, so that its timing
 * line is written: with g.lock held and no op in flight, none can start one
 * meanwhile (the thread takes no lock of the shim's). */
void content_exit(void)
{
    pthread_mutex_lock(&g.lock);
    if (!g.busy)
        content_settle();
    pthread_mutex_unlock(&g.lock);
}

/* Give the staged copies of the loaded `items` back: on a thread of its own
 * (SNAPSHOT_SHIM_STAGING_RELEASE_AFTER_REPLY, the default), else here. Their
 * o->host is cleared either way; the resident mapping stays. */
static void release_hosts(struct item *items, uint32_t count)
{
    struct host_range *ranges = NULL;
    uint32_t k = 0;
    uint64_t bytes = 0;
    sigset_t all, old;
    int e;

    content_settle();
    if (shim_settings()->staging_release_after_reply)
        ranges = malloc((count ? count : 1) * sizeof *ranges);
    for (uint32_t i = 0; i < count; i++) {
        struct obj *o = items[i].o;
        if (!ranges || o->host_kept || in_resident(o->host)) {
            unmap_host(o);
            continue;
        }
        if (k && ranges[k - 1].p + ranges[k - 1].len == o->host)
            ranges[k - 1].len += o->host_len;
        else
            ranges[k++] = (struct host_range){o->host, o->host_len};
        bytes += o->host_len;
        o->host = NULL;
        o->host_len = 0;
    }
    if (!ranges)
        return;
    if (k == 0) { /* every copy was in the resident mapping */
        free(ranges);
        return;
    }
    releasing = (struct releasing){.pid = getpid(), .ranges = ranges, .count = k,
                                   .bytes = bytes};
    sigfillset(&all); /* the application's handlers run on its own threads */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    e = pthread_create(&releasing.tid, NULL, release_main, &releasing);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e == 0) {
        releasing.running = true;
        return;
    }
    shim_log(LOG_WARN, "pthread_create failed (%s): freeing %llu staged bytes before the reply",
             strerror(e), (unsigned long long)bytes);
    release_ranges(ranges, k);
    free(ranges);
    memset(&releasing, 0, sizeof releasing);
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

/* `text` for a JSON string: quotes, backslashes and controls dropped (a
 * CUresult name and our own words are all it holds). */
static void json_text(char *out, size_t n, const char *text)
{
    size_t k = 0;

    for (; *text && k + 1 < n; text++)
        if (*text != '"' && *text != '\\' && (unsigned char)*text >= 0x20)
            out[k++] = *text;
    out[k] = 0;
}

static const char *hash_name(uint32_t state)
{
    switch (state) {
    case CUIP_HASH_COMPARED:
        return "compared";
    case CUIP_HASH_FIRST:
        return "first";
    case CUIP_HASH_UNAVAILABLE:
        return "unavailable";
    default:
        return "none";
    }
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
    if (keep_enabled()) {
        if (keep_record(r, st->bytes_copied, st->bytes_unchanged, st->hash_state) != 0)
            shim_log(LOG_WARN, "%s: out of memory for the kept host copy's record", op);
        if (st->hash_state == CUIP_HASH_UNAVAILABLE)
            reply_msg(r, CUIP_STATUS_OK, "%s copied every byte of the kept host copies: %s",
                      op, st->hash_why);
        shim_log(LOG_INFO, "%s: kept host copies: %llu bytes copied, %llu unchanged (hash %s%s%s)",
                 op, (unsigned long long)st->bytes_copied,
                 (unsigned long long)st->bytes_unchanged, hash_name(st->hash_state),
                 st->hash_why[0] ? ": " : "", st->hash_why);
    }
    if (cfg->timing) {
        char line[2048], why[sizeof st->hash_why];
        json_text(why, sizeof why, st->hash_why);
        int m = snprintf(
            line, sizeof line,
            "cuinterpose-timing {\"pid\": %d, \"op\": \"%s\", \"allocations\": %llu, "
            "\"bytes\": %llu, \"threads\": %u, \"chunk\": %zu, \"chunks\": %llu, "
            "\"thp\": %s, \"bounce\": %zu, \"bounce_pin\": \"%s\", \"bounce_keep\": %s, "
            "\"depth\": %u, \"populate_threads\": %u, \"populate_method\": \"%s\", "
            "\"populated_ahead\": %llu, "
            "\"chunks_per_thread\": %u, \"resident\": %s, "
            "\"kept\": %s, \"bytes_copied\": %llu, \"bytes_unchanged\": %llu, "
            "\"hash\": \"%s\", \"hash_s\": %.6f, \"hash_why\": \"%s\", "
            "\"elapsed_s\": %.6f, \"setup_s\": %.6f, "
            "\"pool_start_s\": %.6f, \"drain_s\": %.6f, \"teardown_s\": %.6f, "
            "\"copy_wall_s\": %.6f, \"create_s\": %.6f, \"map_s\": %.6f, "
            "\"thread_s\": {\"populate\": %.6f, \"register\": %.6f, \"copy\": %.6f, "
            "\"unregister\": %.6f, \"release\": %.6f, \"memcpy\": %.6f, \"stream\": %.6f}}\n",
            (int)getpid(), op, (unsigned long long)st->count, (unsigned long long)st->bytes,
            t->threads, t->chunk, (unsigned long long)t->chunks,
            cfg->staging_thp ? "true" : "false", cfg->staging_bounce,
            cfg->staging_bounce_register ? "register" : "alloc",
            cfg->staging_bounce_keep ? "true" : "false", cfg->staging_depth,
            cfg->staging_ahead, populate_name(t->populate_how),
            (unsigned long long)t->populated_chunks, t->spread, st->resident ? "true" : "false",
            keep_enabled() ? "true" : "false", (unsigned long long)st->bytes_copied,
            (unsigned long long)st->bytes_unchanged, hash_name(st->hash_state),
            (double)st->hash_ns / 1e9, why,
            (double)ns / 1e9, (double)st->setup_ns / 1e9, (double)t->pool_start_ns / 1e9,
            (double)st->drain_ns / 1e9, (double)st->teardown_ns / 1e9,
            (double)t->copy_wall_ns / 1e9, (double)st->create_ns / 1e9,
            (double)st->map_ns / 1e9, (double)t->populate_ns / 1e9,
            (double)t->register_ns / 1e9, (double)t->copy_ns / 1e9,
            (double)t->unregister_ns / 1e9, (double)t->release_ns / 1e9,
            (double)t->memcpy_ns / 1e9, (double)t->stream_ns / 1e9);
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

/* The next run of chunks of a kept item whose hashes differ (all of them
 * without hashes), from chunk *j on: bytes [*from, *to) of the allocation;
 * false when none is left. */
static bool next_run(const struct item *it, uint64_t *j, uint64_t *from, uint64_t *to)
{
    uint64_t size = it->o->size, chunks = kh_chunks(size), k;

    while (*j < chunks && keep_chunk_same(it->kc, it->fresh, *j))
        (*j)++;
    if (*j == chunks)
        return false;
    for (k = *j; k < chunks && !keep_chunk_same(it->kc, it->fresh, k); k++)
        ;
    *from = *j * KH_CHUNK;
    *to = k * KH_CHUNK < size ? k * KH_CHUNK : size;
    *j = k;
    return true;
}

/* SAVE with kept host copies: each kept item's VA, the hashes of its
 * device bytes, and what moves (`*copy`, `*runs`). A failed hash copies
 * everything and says why (st->hash_why); a failed VA fails the op. */
static int plan_kept(struct item *items, uint32_t count, struct stats *st, uint64_t *copy,
                     uint32_t *runs, char *msg, size_t n)
{
    struct keep_item *ki;
    uint32_t nk = 0, k = 0;
    uint64_t t0;
    bool first = false;

    for (uint32_t i = 0; i < count; i++)
        if (items[i].kc)
            nk++;
    if (nk == 0)
        return 0;
    ki = calloc(nk, sizeof *ki);
    if (!ki) {
        snprintf(msg, n, "out of memory for %u kept items", nk);
        return -1;
    }
    for (uint32_t i = 0; i < count; i++) {
        struct item *it = &items[i];
        bool pushed;
        CUresult r;
        if (!it->kc)
            continue;
        r = shim_ctx_enter(it->o->ctx, &pushed);
        if (r != CUDA_SUCCESS) {
            shim_fail(msg, n, "cuCtxPushCurrent", r);
            name_allocation(msg, n, it->o);
            free(ki);
            return -1;
        }
        r = pick_va(it, it->o->real, msg, n) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
        shim_ctx_leave(pushed);
        if (r != CUDA_SUCCESS) {
            name_allocation(msg, n, it->o);
            free(ki);
            return -1;
        }
        ki[k++] = (struct keep_item){it->kc, it->va, it->o->ctx, NULL};
        first = first || !it->kc->valid;
    }
    t0 = shim_now_ns();
    if (keep_hash(ki, nk, st->hash_why, sizeof st->hash_why) != 0) {
        st->hash_state = CUIP_HASH_UNAVAILABLE;
        shim_log(LOG_WARN, "SAVE_ALLOCATIONS copies every byte of the kept host copies: %s",
                 st->hash_why);
    } else {
        st->hash_state = first ? CUIP_HASH_FIRST : CUIP_HASH_COMPARED;
    }
    st->hash_ns = shim_now_ns() - t0;
    k = 0;
    for (uint32_t i = 0; i < count; i++) {
        struct item *it = &items[i];
        uint64_t j = 0, from, to;
        if (!it->kc)
            continue;
        it->fresh = ki[k++].fresh;
        while (next_run(it, &j, &from, &to)) {
            *copy += to - from;
            (*runs)++;
        }
        st->bytes_unchanged += it->o->size;
    }
    st->bytes_unchanged -= *copy;
    free(ki);
    return 0;
}

/* The items' host slices: the kept host copies (SNAPSHOT_SHIM_KEEP_HOST_COPY),
 * only their changed chunks copied, straight; the others in one staging
 * mapping, queued as their VAs are ready. On failure nothing is kept: no
 * o->host is set, the mapping is gone, every temporary mapping undone, and
 * the kept copies are no longer trusted (their hashes dropped). */
static int save_items(struct item *items, uint32_t count, struct stats *st, char *msg,
                      size_t n)
{
    size_t len = 0, off = 0;
    char *arena = NULL;
    struct staging *s = NULL;
    uint32_t queued = 0, runs = 0, staged = 0;
    uint64_t kept_copy = 0, total = 0;
    int rc = 0;
    uint64_t t0, t1;
    char ignored[8];

    for (uint32_t i = 0; i < count; i++) {
        struct keep_copy *c = keep_of(items[i].o);
        items[i].kc = c && c->host ? c : NULL;
        if (c && !c->host)
            shim_log(LOG_WARN, "SAVE_ALLOCATIONS: an allocation of %llu bytes has no kept host "
                     "copy (%s): staged through the staging memory",
                     (unsigned long long)items[i].o->size, c->why);
        if (!items[i].kc) {
            len += staging_len(items[i].o->size);
            total += items[i].o->size;
            staged++;
        }
    }
    if (plan_kept(items, count, st, &kept_copy, &runs, msg, n) != 0)
        goto fail_vas;
    total += kept_copy;
    st->bytes_copied = total;
    __atomic_store_n(&g.phase_bytes_total, total, __ATOMIC_RELAXED);
    if (len) {
        arena = arena_get(len, &st->resident, msg, n);
        if (!arena)
            goto fail_vas;
    }
    s = staging_start(true, st->resident, total ? total : 1, runs + staged, msg, n);
    if (!s) {
        if (arena)
            arena_put(arena, len);
        goto fail_vas;
    }
    t0 = shim_now_ns();
    for (; queued < count && rc == 0; queued++) {
        struct item *it = &items[queued];
        bool pushed;
        CUresult r;
        if (it->kc) {
            uint64_t j = 0, from, to;
            while (rc == 0 && next_run(it, &j, &from, &to))
                if (staging_add_range(s, it->o, it->kc->host + from, it->va + from, it->o->ctx,
                                      from, to - from, true) != 0) {
                    snprintf(msg, n, "the staging queue is full (an internal bound is wrong)");
                    name_allocation(msg, n, it->o);
                    rc = -1;
                }
            continue;
        }
        r = shim_ctx_enter(it->o->ctx, &pushed);
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
    for (uint32_t i = 0; i < count; i++)
        if (drop_va(&items[i], rc == 0 ? msg : ignored, rc == 0 ? n : sizeof ignored) != 0)
            rc = -1;
    if (rc != 0) {
        if (arena)
            arena_put(arena, len);
        for (uint32_t i = 0; i < count; i++)
            if (items[i].kc)
                keep_settle(items[i].kc, items[i].fresh, false);
        st->teardown_ns = shim_now_ns() - t0;
        return -1;
    }
    off = 0;
    for (uint32_t i = 0; i < count; i++) {
        struct obj *o = items[i].o;
        if (items[i].kc) {
            keep_settle(items[i].kc, items[i].fresh, true);
            o->host = items[i].kc->host;
            o->host_len = items[i].kc->len;
            o->host_kept = true;
        } else {
            o->host = arena + off;
            o->host_len = staging_len(o->size);
            o->host_kept = false;
            off += o->host_len;
        }
        st->count++;
        st->bytes += o->size;
    }
    st->teardown_ns = shim_now_ns() - t0;
    return 0;
fail_vas:
    for (uint32_t i = 0; i < count; i++) {
        drop_va(&items[i], ignored, sizeof ignored);
        if (items[i].kc)
            keep_settle(items[i].kc, items[i].fresh, false);
    }
    return -1;
}

enum phase_result content_save(struct reply *r)
{
    struct stats st;
    struct item *items = NULL;
    uint64_t total, t0 = shim_now_ns();
    uint32_t count, k = 0;
    char msg[MSG_LEN];
    bool held;

    memset(&st, 0, sizeof st);
    if (shim_settings()->native_content)
        return PHASE_DONE; /* the native checkpoint moves the bytes */
    content_settle();
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
    held = keep_begin() == 0;
    if (count && save_items(items, count, &st, msg, sizeof msg) != 0) {
        if (held)
            keep_end();
        free(items);
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "SAVE_ALLOCATIONS: %s", msg);
        return PHASE_FAILED;
    }
    free(items);
    report_done(r, "SAVE_ALLOCATIONS", &st, t0);
    if (held)
        keep_end();
    return PHASE_DONE;
}

/* Re-create `it->o` with its recorded properties and map it at its
 * recorded VAs, and pick the copy's VA. On failure the allocation's own
 * partial work is undone: no handle, no mapping, not live, its staged bytes
 * kept; `*retry` says the driver was out of memory and the undo was clean.
 * Called with it->o->ctx current. */
static int create_one(struct item *it, struct stats *st, bool *retry, char *msg, size_t n)
{
    struct obj *o = it->o;
    CUmemGenericAllocationHandle h = 0;
    char ignored[8];
    uint64_t t0 = shim_now_ns();
    CUresult r = real.cuMemCreate(&h, o->size, &o->prop, 0);

    st->create_ns += shim_now_ns() - t0;
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
    t0 = shim_now_ns();
    r = unicast_load_mappings(o, msg, n); /* undoes its own partial work */
    st->map_ns += shim_now_ns() - t0;
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

/* Load `items` (not live, bytes staged): create and map each, queue its
 * copy while the pool copies the earlier ones, then make the copied ones
 * live. The first creation that fails stops the queueing: the earlier
 * ones still finish (and stay live), the failed one is undone (*retry: out
 * of memory). A failed copy undoes every item of the op (FAILED). Staged
 * bytes are given back only when `!keep` and the item is live. */
static int load_items(struct item *items, uint32_t count, uint64_t total, bool keep,
                      struct stats *st, bool *retry, char *msg, size_t n)
{
    struct staging *s = staging_start(false, false, total, count, msg, n);
    uint32_t made = 0;
    int produce_rc = 0, copy_rc;
    uint64_t t0 = shim_now_ns(), t1;
    char copy_msg[MSG_LEN];

    *retry = false;
    if (!s)
        return -1;
    copy_msg[0] = 0;
    for (; made < count; made++) {
        struct item *it = &items[made];
        bool pushed;
        CUresult r = shim_ctx_enter(it->o->ctx, &pushed);
        if (r != CUDA_SUCCESS) {
            shim_fail(msg, n, "cuCtxPushCurrent", r);
            produce_rc = -1;
            break;
        }
        produce_rc = create_one(it, st, retry, msg, n);
        shim_ctx_leave(pushed);
        if (produce_rc != 0)
            break;
        if (staging_add_range(s, it->o, it->o->host, it->va, it->o->ctx, 0, it->o->size,
                              it->o->host_kept) != 0) {
            snprintf(msg, n, "the staging queue is full (an internal bound is wrong)");
            drop_va(it, copy_msg, sizeof copy_msg);
            uncreate(it);
            produce_rc = -1;
            break;
        }
    }
    if (produce_rc != 0)
        name_allocation(msg, n, items[made].o);
    t1 = shim_now_ns();
    copy_rc = staging_wait(s, copy_msg, sizeof copy_msg);
    st->setup_ns = t1 - t0;
    st->drain_ns = shim_now_ns() - t1;
    t0 = shim_now_ns();
    for (uint32_t i = 0; i < made; i++)
        if (drop_va(&items[i], copy_msg, sizeof copy_msg) != 0)
            copy_rc = -1;
    if (copy_rc != 0) {
        for (uint32_t i = 0; i < made; i++)
            uncreate(&items[i]);
        staging_stop(s, &st->st);
        snprintf(msg, n, "%s", copy_msg);
        *retry = false;
        st->teardown_ns = shim_now_ns() - t0;
        return -1;
    }
    if (!keep && !shim_settings()->staging_release_after_reply) {
        for (uint32_t i = 0; i < made; i++)
            if (!items[i].o->host_kept && !in_resident(items[i].o->host))
                staging_release(s, items[i].o->host, items[i].o->host_len);
        staging_wait(s, copy_msg, sizeof copy_msg);
    }
    staging_stop(s, &st->st);
    if (!keep)
        release_hosts(items, made);
    for (uint32_t i = 0; i < made; i++) {
        struct obj *o = items[i].o;
        st->count++;
        st->bytes += o->size;
        st->bytes_copied += o->size;
        pthread_mutex_lock(&g.lock);
        o->live = true;
        pthread_mutex_unlock(&g.lock);
    }
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
    content_settle();
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
    content_settle();
    free_hosts();
}

void content_drop_resident(void)
{
    content_settle();
    keep_give_back();
    if (!resident.p || resident_in_use())
        return;
    if (resident.pid == getpid() && munmap(resident.p, resident.len) != 0)
        shim_log(LOG_WARN, "munmap of the resident staging memory failed: %s", strerror(errno));
    resident.p = NULL;
    resident.len = 0;
}
