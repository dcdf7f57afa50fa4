/*
 * Allocation content: SAVE_ALLOCATIONS and LOAD_ALLOCATIONS.
 *
 * Creators copy every shared allocation to host memory through a temporary
 * mapping of the whole allocation (the application's own mappings may be
 * partial or read-only). LOAD re-creates each allocation with its original
 * properties, maps it at its original VAs with its access, copies the bytes
 * back and drops the host copy. ROLLBACK_ALLOCATIONS does the same but keeps
 * the host copies (ROLLBACK_IMPORTS frees them once every importer has
 * imported again). An allocation that fails to load is left as it was
 * (torn down, its bytes staged); out of device memory, the op answers RETRY. Runs on the control thread without g.lock:
 * outside ACTIVE the application cannot change the tables.
 *
 * Host storage is one anonymous private mapping per allocation, NOT
 * cuMemHostAlloc: on the H200 the driver hands out pinned memory at ~2 GB/s
 * whatever the thread count (it serializes), which made SAVE run at 1.6 GB/s
 * against a 55 GB/s copy (specs/records/2026-11-29-h200-host-staging.jsonl).
 * Instead a few worker threads take fixed chunks of the mapping; for each:
 * populate the pages, cuMemHostRegister the chunk, copy on the worker's own
 * stream, synchronize, cuMemHostUnregister. Registering chunks of plain
 * anonymous memory from 16 threads ran at ~11 GB/s there. No registration
 * outlives its chunk, so the native checkpoint and CRIU see plain anonymous
 * memory between SAVE and LOAD.
 *
 * Defaults (both overridable, values checked by settings.c):
 *  - SNAPSHOT_SHIM_COPY_THREADS: min(16, online CPUs). Populate and register
 *    are CPU work in the kernel that scales with threads (8.3 GB/s touching
 *    from 16 threads); 16 was the measured sweet spot on the H200 host, and
 *    more threads than CPUs only contend.
 *  - SNAPSHOT_SHIM_COPY_CHUNK_MIB: 64. A worker moves ~0.7 GB/s (11 GB/s over
 *    16), so a 64 MiB chunk is ~90 ms of work: the fixed cost of a register
 *    and a stream sync is noise against it, while an allocation of 1 GiB
 *    already keeps 16 threads busy (256 MiB chunks need 4 GiB) and the tail,
 *    where the last chunks run with idle threads, is 4x shorter. The probe
 *    measured 256 MiB chunks; rerun it at 64 if in doubt.
 *
 * Allocations are processed one after another; within one, the control
 * thread and up to threads-1 helpers share an atomic chunk counter. The
 * first error wins (its message names the call, the result, the allocation
 * and the chunk offset); the others stop taking chunks and all are joined.
 */
#include "shim.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack it */
#endif

#define MSG_LEN 512

struct stats {
    uint64_t count, bytes, copy_ns, chunks;
    unsigned threads; /* most threads one allocation ran on */
};

/* MADV_POPULATE_WRITE unknown to this kernel: touch the pages instead. Set
 * once, by whichever thread learns it first. */
static int no_populate;

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

/* ------------------------------------------------------------ chunked copy */
struct job {
    const struct obj *o;
    CUcontext ctx;          /* the control thread's current one, entered by helpers */
    bool to_host;
    char *host;
    CUdeviceptr va;
    size_t size, chunk, nchunks;
    size_t next;            /* atomic: next chunk to take */
    int failed;             /* atomic: set once, by the first error */
    char msg[MSG_LEN];      /* written only by the thread that set `failed` */
    /* Copy time: wall time during which at least one chunk was between its
     * copy call and the end of its stream sync (the union of those
     * intervals over all threads). Unlike a per-thread sum it never exceeds
     * the elapsed time; populate and register time outside any copy is not
     * counted. */
    pthread_mutex_t tlock;
    unsigned active;
    uint64_t busy_since, copy_ns;
};

static void job_fail(struct job *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void job_fail(struct job *j, const char *fmt, ...)
{
    int expect = 0;
    char id[2 * CUIP_ID_LEN + 1];
    va_list ap;
    int m;

    if (!__atomic_compare_exchange_n(&j->failed, &expect, 1, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return; /* the first error wins */
    va_start(ap, fmt);
    m = vsnprintf(j->msg, sizeof j->msg, fmt, ap);
    va_end(ap);
    shim_hex(id, j->o->id, CUIP_ID_LEN);
    id[2 * CUIP_ID_LEN] = 0;
    if (m >= 0 && (size_t)m < sizeof j->msg)
        snprintf(j->msg + m, sizeof j->msg - (size_t)m, " (allocation %s, %zu bytes)", id,
                 j->size);
}

static void cu_fail(struct job *j, const char *call, CUresult r, size_t off)
{
    job_fail(j, "%s failed: %s (%d) at chunk offset %zu", call, shim_cu_name(r), (int)r, off);
}

static void copy_begin(struct job *j)
{
    pthread_mutex_lock(&j->tlock);
    if (j->active++ == 0)
        j->busy_since = shim_now_ns();
    pthread_mutex_unlock(&j->tlock);
}

static void copy_end(struct job *j)
{
    pthread_mutex_lock(&j->tlock);
    if (--j->active == 0)
        j->copy_ns += shim_now_ns() - j->busy_since;
    pthread_mutex_unlock(&j->tlock);
}

/* Fault in the pages of a fresh anonymous range for writing, before the
 * register pins them (measured faster than letting the register fault them
 * in). MADV_POPULATE_WRITE needs Linux 5.14; an older kernel answers EINVAL
 * for the unknown advice (the range itself is page-aligned and mapped, so
 * EINVAL means nothing else), and then we write one byte per page instead:
 * a write, not a read, or the kernel maps the shared zero page. */
static int populate(char *p, size_t len)
{
    if (!__atomic_load_n(&no_populate, __ATOMIC_RELAXED)) {
        for (;;) {
            if (madvise(p, len, MADV_POPULATE_WRITE) == 0)
                return 0;
            if (errno == EINTR || errno == EAGAIN)
                continue;
            if (errno != EINVAL)
                return -1;
            __atomic_store_n(&no_populate, 1, __ATOMIC_RELAXED);
            break;
        }
    }
    {
        long pg = sysconf(_SC_PAGESIZE);
        size_t step = pg > 0 ? (size_t)pg : 4096;
        for (size_t i = 0; i < len; i += step)
            ((volatile char *)p)[i] = 0;
    }
    return 0;
}

/* One chunk: [populate,] register, copy, sync, unregister. The registration
 * never outlives the call, whatever fails. */
static int do_chunk(struct job *j, CUstream s, size_t k)
{
    size_t off = k * j->chunk;
    size_t len = j->size - off < j->chunk ? j->size - off : j->chunk;
    char *p = j->host + off;
    CUresult r, r2;

    if (j->to_host && populate(p, len) != 0) {
        int e = errno;
        job_fail(j, "madvise(MADV_POPULATE_WRITE) failed: %s (errno %d) at chunk offset %zu",
                 strerror(e), e, off);
        return -1;
    }
    r = real.cuMemHostRegister(p, len, 0);
    if (r != CUDA_SUCCESS) {
        cu_fail(j, "cuMemHostRegister", r, off);
        return -1;
    }
    copy_begin(j);
    if (j->to_host)
        r = real.cuMemcpyDtoHAsync(p, j->va + off, len, s);
    else
        r = real.cuMemcpyHtoDAsync(j->va + off, p, len, s);
    if (r != CUDA_SUCCESS)
        cu_fail(j, j->to_host ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync", r, off);
    /* Always drain the stream before the pages are unpinned. */
    r2 = real.cuStreamSynchronize(s);
    copy_end(j);
    if (r2 != CUDA_SUCCESS && r == CUDA_SUCCESS) {
        cu_fail(j, "cuStreamSynchronize", r2, off);
        r = r2;
    }
    r2 = real.cuMemHostUnregister(p);
    if (r2 != CUDA_SUCCESS && r == CUDA_SUCCESS) {
        cu_fail(j, "cuMemHostUnregister", r2, off);
        r = r2;
    }
    if (r != CUDA_SUCCESS)
        return -1;
    __atomic_fetch_add(&g.phase_bytes_done, (uint64_t)len, __ATOMIC_RELAXED); /* for STATUS */
    return 0;
}

static void *copy_worker(void *arg)
{
    struct job *j = arg;
    CUstream s = NULL;
    bool pushed = false;
    CUresult r = shim_ctx_enter(j->ctx, &pushed);

    if (r != CUDA_SUCCESS) {
        job_fail(j, "cuCtxPushCurrent failed: %s (%d)", shim_cu_name(r), (int)r);
        return NULL;
    }
    r = real.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS) {
        job_fail(j, "cuStreamCreate failed: %s (%d)", shim_cu_name(r), (int)r);
        shim_ctx_leave(pushed);
        return NULL;
    }
    while (!__atomic_load_n(&j->failed, __ATOMIC_ACQUIRE)) {
        size_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (k >= j->nchunks || do_chunk(j, s, k) != 0)
            break;
    }
    r = real.cuStreamDestroy(s);
    if (r != CUDA_SUCCESS)
        job_fail(j, "cuStreamDestroy failed: %s (%d)", shim_cu_name(r), (int)r);
    shim_ctx_leave(pushed);
    return NULL;
}

/* Copy between `host` and `va` (o->size bytes) on the calling thread and up
 * to threads-1 helpers (`tids`, threads-1 entries, from the op). */
static int copy_chunks(const struct obj *o, bool to_host, char *host, CUdeviceptr va,
                       pthread_t *tids, struct stats *st, char *msg, size_t n)
{
    const struct shim_settings *cfg = shim_settings();
    struct job j;
    unsigned want, started = 0;
    sigset_t all, old;
    CUresult r;

    memset(&j, 0, sizeof j);
    j.o = o;
    j.to_host = to_host;
    j.host = host;
    j.va = va;
    j.size = o->size;
    j.chunk = cfg->copy_chunk;
    j.nchunks = (o->size + cfg->copy_chunk - 1) / cfg->copy_chunk;
    r = real.cuCtxGetCurrent(&j.ctx);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxGetCurrent", r);
        return -1;
    }
    if (pthread_mutex_init(&j.tlock, NULL) != 0) {
        snprintf(msg, n, "pthread_mutex_init failed");
        return -1;
    }
    want = j.nchunks < cfg->copy_threads ? (unsigned)j.nchunks : cfg->copy_threads;
    /* Helpers take no signals, like the control thread: the application's
     * handlers run on its own threads. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (; started + 1 < want; started++) {
        int e = pthread_create(&tids[started], NULL, copy_worker, &j);
        if (e != 0) { /* fewer helpers: the chunk counter is shared, so still correct */
            shim_log(LOG_WARN, "pthread_create failed (%s): copying with %u threads",
                     strerror(e), started + 1);
            break;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    copy_worker(&j);
    for (unsigned i = 0; i < started; i++)
        pthread_join(tids[i], NULL);
    pthread_mutex_destroy(&j.tlock);
    st->copy_ns += j.copy_ns;
    st->chunks += j.nchunks;
    if (started + 1 > st->threads)
        st->threads = started + 1;
    if (j.failed) {
        snprintf(msg, n, "%s", j.msg);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------ phases */
static bool creator_shared(const struct obj *o)
{
    return o && obj_shared(o) && o->is_creator;
}

static void free_hosts(void)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (o && o->host) {
            if (munmap(o->host, o->size) != 0)
                shim_log(LOG_WARN, "munmap of a saved copy failed: %s", strerror(errno));
            o->host = NULL;
        }
    }
}

/* The settings and entry points, or a message. */
static int copy_setup(pthread_t **tids, char *msg, size_t n)
{
    unsigned threads = shim_settings()->copy_threads;

    if (!shim_resolve_host_register() || !real.cuCtxGetCurrent || !real.cuStreamCreate ||
        !real.cuStreamSynchronize || !real.cuStreamDestroy) {
        snprintf(msg, n, "the driver lacks cuMemHostRegister/cuMemHostUnregister or the "
                         "stream entry points");
        return -1;
    }
    *tids = calloc(threads, sizeof **tids); /* once per op, never per chunk */
    if (!*tids) {
        snprintf(msg, n, "out of memory for %u copy threads", threads);
        return -1;
    }
    return 0;
}

static int save_one(struct obj *o, pthread_t *tids, struct stats *st, char *msg, size_t n)
{
    CUdeviceptr va = 0;
    void *host;
    bool pushed;
    CUresult r = shim_ctx_enter(o->ctx, &pushed);

    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", r);
        return -1;
    }
    host = mmap(NULL, o->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                -1, 0);
    if (host == MAP_FAILED) {
        int e = errno;
        snprintf(msg, n, "mmap of %llu bytes failed: %s (errno %d)", (unsigned long long)o->size,
                 strerror(e), e);
        goto fail;
    }
    if (temp_map(o, o->real, &va, msg, n) != 0)
        goto fail_host;
    if (copy_chunks(o, true, host, va, tids, st, msg, n) != 0) {
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
    if (munmap(host, o->size) != 0)
        shim_log(LOG_WARN, "munmap of a saved copy failed: %s", strerror(errno));
fail:
    shim_ctx_leave(pushed);
    return -1;
}

/* A finished op's figures: logged, and in the reply. */
static void report_done(struct reply *r, const char *op, const struct stats *st, uint64_t t0)
{
    const struct shim_settings *cfg = shim_settings();
    uint64_t ns = shim_now_ns() - t0;
    shim_log(LOG_INFO,
             "%s: %llu allocations, %llu bytes, %llu chunks of %zu MiB on %u of %u threads, "
             "%.2f GB/s end to end, copy %.3f s",
             op, (unsigned long long)st->count, (unsigned long long)st->bytes,
             (unsigned long long)st->chunks, cfg->copy_chunk >> 20, st->threads,
             cfg->copy_threads,
             ns ? (double)st->bytes / (double)ns : 0.0, (double)st->copy_ns / 1e9);
    r->h.stat_count = st->count;
    r->h.stat_bytes = st->bytes;
    r->h.stat_copy_ns = st->copy_ns;
}

enum phase_result content_save(struct reply *r)
{
    struct stats st = {0, 0, 0, 0, 0};
    pthread_t *tids = NULL;
    uint64_t t0 = shim_now_ns();
    char msg[MSG_LEN];

    if (shim_settings()->native_content)
        return PHASE_DONE; /* the native checkpoint moves the bytes */
    for (uint32_t i = 0; i < obj_count(); i++) { /* the total, for STATUS */
        struct obj *o = obj_at(i);
        if (creator_shared(o) && o->live && !o->host)
            __atomic_fetch_add(&g.phase_bytes_total, o->size, __ATOMIC_RELAXED);
    }
    if (copy_setup(&tids, msg, sizeof msg) != 0) {
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "SAVE_ALLOCATIONS: %s", msg);
        return PHASE_FAILED;
    }
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!creator_shared(o) || !o->live || o->host)
            continue;
        if (save_one(o, tids, &st, msg, sizeof msg) != 0) {
            free(tids);
            free_hosts(); /* nothing is torn down before PREPARE_UNICAST: all live */
            reply_msg(r, CUIP_STATUS_CUDA_FAILED, "SAVE_ALLOCATIONS: %s", msg);
            return PHASE_FAILED;
        }
    }
    free(tids);
    report_done(r, "SAVE_ALLOCATIONS", &st, t0);
    return PHASE_DONE;
}

/* Re-create `o` with its recorded properties, map it at its recorded VAs
 * and refill it from its staged bytes (kept when `keep`, else freed once it
 * is live). On failure the allocation's own partial work is undone: no
 * handle, no mapping, not live, its staged bytes kept, so the op may run
 * again or roll back; `*retry` says the driver was out of memory and the
 * undo was clean. */
static int load_one(struct obj *o, bool keep, pthread_t *tids, struct stats *st, bool *retry,
                    char *msg, size_t n)
{
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    bool pushed;
    char ignored[8];
    CUresult r = shim_ctx_enter(o->ctx, &pushed);

    *retry = false;
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", r);
        return -1;
    }
    r = real.cuMemCreate(&h, o->size, &o->prop, 0);
    if (r != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemCreate", r);
        *retry = r == CUDA_ERROR_OUT_OF_MEMORY;
        goto fail;
    }
    if (SHIM_IS_TAGGED(h)) {
        snprintf(msg, n, "cuMemCreate: driver handle collides with the shim's tag range");
        goto fail_h;
    }
    pthread_mutex_lock(&g.lock); /* readers check `live` first, but keep it clean */
    o->real = h;
    pthread_mutex_unlock(&g.lock);
    r = unicast_load_mappings(o, msg, n); /* undoes its own partial work */
    if (r != CUDA_SUCCESS) {
        *retry = r == CUDA_ERROR_OUT_OF_MEMORY;
        goto fail_h;
    }
    if (temp_map(o, h, &va, msg, n) != 0)
        goto fail_maps;
    if (copy_chunks(o, false, o->host, va, tids, st, msg, n) != 0) {
        temp_unmap(o, va, ignored, sizeof ignored);
        goto fail_maps;
    }
    if (temp_unmap(o, va, msg, n) != 0)
        goto fail_maps;
    if (!keep) {
        if (munmap(o->host, o->size) != 0)
            shim_log(LOG_WARN, "munmap of a saved copy failed: %s", strerror(errno));
        o->host = NULL;
    }
    st->count++;
    st->bytes += o->size;
    shim_ctx_leave(pushed);
    pthread_mutex_lock(&g.lock);
    o->live = true;
    pthread_mutex_unlock(&g.lock);
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
fail:
    /* The staged bytes stay: never freed on a failure path. */
    shim_ctx_leave(pushed);
    return -1;
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

/* Every creator-owned shared allocation that is not live, loaded again from
 * its staged bytes; live ones are skipped, so the op is idempotent and a
 * retry after RETRY finishes the rest. */
static enum phase_result load_all(struct reply *r, const char *op, bool keep)
{
    struct stats st = {0, 0, 0, 0, 0};
    pthread_t *tids = NULL;
    uint64_t t0 = shim_now_ns();
    char msg[MSG_LEN];
    bool retry;

    for (uint32_t i = 0; i < obj_count(); i++) { /* the total, for STATUS */
        struct obj *o = obj_at(i);
        if (creator_shared(o) && !o->live && o->host)
            __atomic_fetch_add(&g.phase_bytes_total, o->size, __ATOMIC_RELAXED);
    }
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!creator_shared(o) || o->live)
            continue;
        if (!o->host) {
            free(tids);
            msg[0] = 0;
            name_allocation(msg, sizeof msg, o);
            reply_msg(r, CUIP_STATUS_INTERNAL, "%s: no saved content%s", op, msg);
            return PHASE_FAILED;
        }
        if (!tids && copy_setup(&tids, msg, sizeof msg) != 0) {
            reply_msg(r, CUIP_STATUS_CUDA_FAILED, "%s: %s", op, msg);
            return PHASE_FAILED;
        }
        if (load_one(o, keep, tids, &st, &retry, msg, sizeof msg) != 0) {
            free(tids);
            if (retry) {
                name_allocation(msg, sizeof msg, o);
                report_done(r, op, &st, t0);
                reply_msg(r, CUIP_STATUS_RETRY, "%s: %s", op, msg);
                return PHASE_RETRY;
            }
            reply_msg(r, CUIP_STATUS_CUDA_FAILED, "%s: %s", op, msg);
            return PHASE_FAILED;
        }
    }
    free(tids);
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
        if (!creator_shared(o) || o->live || o->host)
            continue;
        name_allocation(what, sizeof what, o);
        reply_msg(r, CUIP_STATUS_REFUSED,
                  "ROLLBACK_ALLOCATIONS: the staged bytes of a torn-down allocation are "
                  "gone%s", what);
        return PHASE_REFUSED;
    }
    return load_all(r, "ROLLBACK_ALLOCATIONS", true);
}

void content_free_staged(void)
{
    free_hosts();
}
