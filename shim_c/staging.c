/*
 * The staging engine: moves the bytes of a whole phase (SAVE or LOAD of
 * every allocation) between device memory and host memory through one
 * worker pool.
 *
 * Why it is shaped like this: the copy itself runs at the bus's ceiling;
 * what costs is everything around it (starting threads, the kernel's first
 * touch of fresh pages, pinning and unpinning, temporary mappings), so the
 * engine does each of those once per phase, beside the copies, never once
 * per allocation. The figures behind each choice are in docs/benchmarks.md
 * (the round each line names) and specs/records/2026-11-29-h200-host-staging.jsonl.
 *  - One pool per phase, started once: the control thread produces work
 *    (SAVE: the host slice of each allocation; LOAD: re-creating and
 *    mapping each allocation) while the pool already copies what is ready.
 *  - One queue of chunks across all allocations: a large allocation is
 *    split, small ones next to each other in host memory share a chunk, so
 *    that many small allocations cost few copies and waits.
 *  - By default nothing is pinned per phase: each thread copies through
 *    its own pinned bounce buffer (SNAPSHOT_SHIM_STAGING_BOUNCE_MIB, kept for
 *    the life of the process) and memcpy's between it and the staging
 *    memory. The buffer is cut in SNAPSHOT_SHIM_STAGING_DEPTH pieces
 *    (bounce_save, load_pipe), so that the copy engine fills or drains one
 *    while the thread memcpy's another; the thread waits on a blocking-sync
 *    event, so that a waiting worker gives its CPU to those that memcpy and
 *    fault pages. Two pieces, because each piece is one copy and one wait
 *    and larger pieces move more per copy ("The bounce buffer in two
 *    pieces"); not a larger buffer, whose memcpy no longer stays in cache
 *    ("The bounce size, the driver's VMM pace").
 *  - With SNAPSHOT_SHIM_STAGING_BOUNCE_MIB=0 each chunk is registered in
 *    place instead: populated, registered, copied, synchronized and
 *    unregistered by one worker, so that no registration outlives its chunk
 *    and the native checkpoint and CRIU see plain anonymous memory; it is
 *    slower, since the driver serializes the registrations ("Round 1").
 *  - Fresh staging memory is faulted in by the memcpy that fills it (each
 *    page zeroed by the kernel just before it is written, while in cache),
 *    not by a pass of its own; SNAPSHOT_SHIM_STAGING_POPULATE_THREADS more
 *    threads can fault it in ahead of the copies (pool_populator,
 *    MADV_POPULATE_WRITE), which helps a cold SAVE and costs a warm one.
 *  - The staging memory is one anonymous mapping per phase advised
 *    MADV_HUGEPAGE (staging_alloc): with 2 MiB pages the first touch, the
 *    pinning and the free each handle 512 times fewer pages.
 *  - A kept host copy (keep.c) is pinned for good: its chunks go straight
 *    between the device and it (direct_copy), no bounce buffer, no fault.
 *
 * Accounting: every copied chunk is counted in exactly one place, into
 * g.phase_bytes_done: run_copy, or for a LOAD through the bounce buffers,
 * whose pipeline runs on across chunks, pipe_settle when the chunk's last
 * copy is waited for (the queue is idle only once every chunk has ended).
 * The first error wins (its message names the call, the result, the
 * allocation and the offset in it); after it the workers drain the queue
 * without running anything.
 */
#include "shim.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack it */
#endif
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif

#define HUGE_PAGE ((size_t)2 << 20)
#define MSG_LEN 512
/* Worker slots: the pool's threads (at most 64, settings.c). */
#define SLOTS 64
/* How long a copy thread waits for a populate thread to finish the chunk it
 * took: populating one chunk (at most SNAPSHOT_SHIM_COPY_CHUNK_MIB) takes
 * well under a second; past this the op fails, naming the chunk, well
 * inside the coordinator's phase timeout (120 s), instead of never ending. */
#define POPULATE_WAIT_S 30
/* The smallest task task_cap makes. */
#define STAGING_TAIL_MIN ((size_t)1 << 20)

enum task_kind { TASK_COPY = 0, TASK_RELEASE = 1 };

/* One copy: a piece of one allocation. */
struct segment {
    char *host;
    CUdeviceptr dev;
    size_t len;
    const struct obj *o;
    size_t offset;              /* in the allocation, for messages */
};

/* Who faults a copy task's staging memory in (SAVE with populate threads):
 * one thread at a time populates a chunk's pages, so that no populate write
 * (the fallback touches them) ever meets the copy thread's memcpy into the
 * same bytes. Under lock. */
enum { POP_NONE = 0, POP_BUSY, POP_DONE, POP_COPYING };

/* A contiguous host range: for TASK_COPY the segments seg0.. seg0+nseg-1
 * lie back to back in it and share one context. */
struct task {
    uint8_t kind;
    uint8_t pop;                /* POP_*, under lock once published */
    bool direct;                /* host memory pinned for good (a kept host copy): no bounce */
    char *host;
    size_t len;
    size_t cap;                 /* published when len reaches it (task_cap) */
    uint32_t seg0, nseg;
    CUcontext ctx;
};

struct staging {
    bool to_host;
    bool populated;             /* SAVE into memory already faulted in (resident) */
    size_t chunk;
    uint64_t total, added;      /* the op's bytes; those queued so far (producer) */
    /* Written by the producer only; a task is read by workers only once
     * published (under lock). */
    struct segment *segs;
    struct task *tasks;
    uint32_t nsegs, cap_segs, ntasks, cap_tasks;
    bool open;                  /* tasks[ntasks] is being filled */

    pthread_mutex_t lock;
    pthread_cond_t more, idle;
    uint32_t published, next, inflight;
    bool closing;

    int failed;                 /* atomic: set once, by the first error */
    char msg[MSG_LEN];          /* written only by the thread that set `failed` */

    pthread_t *tids;
    unsigned started;
    /* Populate-ahead threads (SAVE into fresh memory only): they fault in
     * the pages of published copy tasks from ahead_next on, skipping those a
     * copy thread has taken (its memcpy faults them). */
    pthread_t *helpers;
    unsigned nhelpers;
    uint32_t ahead_next;        /* under lock */
    pthread_cond_t ahead_more;
    pthread_cond_t popped;      /* a task left POP_BUSY (CLOCK_MONOTONIC) */
    bool plan_populate;         /* some chunk of this op is populated before its copy */
    unsigned slots;             /* bounce slots handed to workers so far */

    /* Copy wall time: the union over all threads of the intervals during
     * which a chunk was between its first copy call and its stream sync. */
    unsigned copying;
    uint64_t copy_since;
    struct staging_times t;     /* under lock */
};

/* MADV_POPULATE_WRITE unknown to this kernel: touch the pages instead. Set
 * once, by whichever thread learns it first. */
static int no_populate;

/* Resident bounce buffers, one per worker slot: pinned on first use and
 * kept, so that no cycle after the first pins anything. Slot i is used by
 * one thread at a time (ops run one at a time on the control thread). A
 * fork child owns none of its parent's (`pid`). Each slot keeps its worker's
 * stream and events too, made in `sctx` on first use: made and destroyed per
 * op they cost every thread ~1 ms at the op's start, beside the control
 * thread's re-creation calls, and its join at the end (thread-s "stream",
 * one H200, 2026-12-02, commit b01d5a7, docs/benchmarks.md). A context
 * destroyed takes what was made in it (staging_forget_ctx). */
static struct bounce {
    void *p;
    size_t size;
    pid_t pid;
    bool registered;            /* our mapping, registered; else cuMemHostAlloc'd */
    CUcontext ctx;              /* where `p` was pinned */
    CUcontext sctx;             /* where `stream` and `done` were made; NULL: none */
    pid_t spid;
    CUstream stream;
    CUevent done[STAGING_DEPTH_MAX];
} bounces[SLOTS];

/* ------------------------------------------------------------ memory */
void *staging_alloc(size_t len, char *msg, size_t n)
{
    size_t span = len + HUGE_PAGE;
    char *p = mmap(NULL, span, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    char *start;
    size_t head, tail;

    if (p == MAP_FAILED) {
        int e = errno;
        snprintf(msg, n, "mmap of %zu bytes of staging memory failed: %s (errno %d)", len,
                 strerror(e), e);
        return NULL;
    }
    /* Aligned to a huge page, so that every 2 MiB of the slices can be one. */
    start = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    head = (size_t)(start - p);
    tail = span - head - len;
    if (head)
        munmap(p, head);
    if (tail)
        munmap(start + len, tail);
    if (shim_settings()->staging_thp && madvise(start, len, MADV_HUGEPAGE) != 0)
        shim_log(LOG_DEBUG, "madvise(MADV_HUGEPAGE) of the staging memory failed: %s "
                            "(transparent huge pages off?); using small pages",
                 strerror(errno));
    return start;
}

size_t staging_len(size_t size)
{
    long pg = sysconf(_SC_PAGESIZE);
    size_t page = pg > 0 ? (size_t)pg : 4096;
    return (size + page - 1) / page * page;
}

/* Unpin and free one bounce buffer (the caller has a context current). */
static void bounce_free(struct bounce *b)
{
    CUresult r;

    if (b->registered) {
        r = real.cuMemHostUnregister(b->p);
        if (r != CUDA_SUCCESS)
            shim_log(LOG_WARN, "cuMemHostUnregister of a bounce buffer failed: %s",
                     shim_cu_name(r));
        else if (munmap(b->p, b->size) != 0)
            shim_log(LOG_WARN, "munmap of a bounce buffer failed: %s", strerror(errno));
    } else {
        r = real.cuMemFreeHost(b->p);
        if (r != CUDA_SUCCESS)
            shim_log(LOG_WARN, "cuMemFreeHost of a bounce buffer failed: %s", shim_cu_name(r));
    }
    b->p = NULL;
}

/* The slot has no stream or events any more (destroyed, or gone with their
 * context). */
static void slot_streams_forget(struct bounce *b)
{
    memset(b->done, 0, sizeof b->done);
    b->stream = NULL;
    b->sctx = NULL;
}

/* Destroy a slot's kept stream and events, its context current; failures
 * are only logged (nothing else can use them: the slot forgets them). */
static void slot_streams_free(struct bounce *b)
{
    CUresult r;

    for (unsigned i = 0; i < STAGING_DEPTH_MAX; i++)
        if (b->done[i] && (r = real.cuEventDestroy(b->done[i])) != CUDA_SUCCESS)
            shim_log(LOG_WARN, "cuEventDestroy of a staging event failed: %s", shim_cu_name(r));
    if (b->stream && (r = real.cuStreamDestroy(b->stream)) != CUDA_SUCCESS)
        shim_log(LOG_WARN, "cuStreamDestroy of a staging stream failed: %s", shim_cu_name(r));
    slot_streams_forget(b);
}

void staging_free_bounces(CUcontext ctx)
{
    bool pushed;

    if (!real.cuMemFreeHost || shim_ctx_enter(ctx, &pushed) != CUDA_SUCCESS)
        return; /* kept: the next op reuses them */
    for (unsigned i = 0; i < SLOTS; i++) {
        struct bounce *b = &bounces[i];
        if (b->p && b->pid == getpid())
            bounce_free(b);
        if (b->sctx == ctx && b->spid == getpid())
            slot_streams_free(b);
    }
    shim_ctx_leave(pushed);
}

void staging_forget_ctx(CUcontext ctx)
{
    for (unsigned i = 0; i < SLOTS; i++) {
        struct bounce *b = &bounces[i];
        if (b->p && b->pid == getpid() && b->ctx == ctx) {
            /* Pinned memory is the context's: cuMemHostAlloc'd, the driver
             * freed it; registered, the mapping is ours and stays mapped. */
            if (b->registered && munmap(b->p, b->size) != 0)
                shim_log(LOG_WARN, "munmap of a bounce buffer failed: %s", strerror(errno));
            b->p = NULL;
        }
        if (b->sctx == ctx && b->spid == getpid())
            slot_streams_forget(b);
    }
}

/* ------------------------------------------------------------ errors */
static void stage_fail(struct staging *s, const struct segment *seg, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void stage_fail(struct staging *s, const struct segment *seg, const char *fmt, ...)
{
    int expect = 0;
    char id[2 * CUIP_ID_LEN + 1];
    va_list ap;
    int m;

    if (!__atomic_compare_exchange_n(&s->failed, &expect, 1, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return; /* the first error wins */
    va_start(ap, fmt);
    m = vsnprintf(s->msg, sizeof s->msg, fmt, ap);
    va_end(ap);
    if (!seg || m < 0 || (size_t)m >= sizeof s->msg)
        return;
    shim_hex(id, seg->o->id, CUIP_ID_LEN);
    id[2 * CUIP_ID_LEN] = 0;
    snprintf(s->msg + m, sizeof s->msg - (size_t)m,
             " at chunk offset %zu (allocation %s, %llu bytes)", seg->offset, id,
             (unsigned long long)seg->o->size);
}

static void cu_fail(struct staging *s, const struct segment *seg, const char *call, CUresult r)
{
    stage_fail(s, seg, "%s failed: %s (%d)", call, shim_cu_name(r), (int)r);
}

static bool has_failed(struct staging *s)
{
    return __atomic_load_n(&s->failed, __ATOMIC_ACQUIRE) != 0;
}

/* ------------------------------------------------------------ a worker */
struct worker {
    unsigned slot;              /* its bounce buffer */
    CUcontext ctx;
    bool entered, pushed;
    CUstream stream;
    /* One per piece of the bounce buffer: recorded after that piece's
     * copies, waited for (blocking, not spinning) before it is touched again. */
    CUevent done[STAGING_DEPTH_MAX];
    bool dirtied;               /* its bounce buffer holds bytes a SAVE copied out */
    /* LOAD: the pipeline runs on from one chunk to the next (load_pipe): a
     * piece's copy still in flight when the worker takes its next chunk, so
     * that the first memcpy of a chunk overlaps the last copy of the one
     * before. `issued` counts the pieces queued; a chunk ends (its bytes
     * counted, the queue told) when its last piece's copy is waited for. */
    struct {
        uint64_t issued;
        unsigned busy;          /* pieces in flight */
        bool open;              /* between copy_begin and copy_end */
        struct {
            bool busy, last;    /* last: the chunk's last piece */
            size_t chunk_len;   /* last: the chunk's bytes, counted when it ends */
            const struct segment *seg; /* for messages */
        } piece[STAGING_DEPTH_MAX];
    } pipe;
    struct staging_times t;     /* this thread's, added to the pool's at the end */
};

/* A SAVE leaves no GPU byte in the bounce buffers: each thread zeroes its own
 * as it leaves (8 MiB by default, all threads at once), while its mapping is
 * still the one it pinned. Later the native checkpoint may change the
 * driver's mappings of pinned memory, and a STORE_STAGED may run beside it,
 * so nothing writes them after a SAVE; `criu dump` then writes no GPU byte
 * of them. */
static void worker_scrub(struct worker *w)
{
    struct bounce *b = &bounces[w->slot];

    if (w->dirtied && b->p && b->pid == getpid())
        memset(b->p, 0, b->size);
    w->dirtied = false;
}

static void worker_leave(struct worker *w)
{
    worker_scrub(w);
    if (!w->entered)
        return;
    w->stream = NULL; /* the slot keeps it */
    memset(w->done, 0, sizeof w->done);
    shim_ctx_leave(w->pushed);
    w->entered = w->pushed = false;
}

/* The slot's stream and events, made in `ctx` now unless the slot has them
 * (ctx current). Another context's are destroyed first, under that context:
 * contexts rarely differ (one per device in practice). */
static int slot_streams(struct staging *s, struct bounce *b, CUcontext ctx)
{
    CUresult r;

    if (b->sctx == ctx && b->spid == getpid())
        return 0;
    if (b->sctx && b->spid == getpid()) {
        bool pushed;
        if (shim_ctx_enter(b->sctx, &pushed) == CUDA_SUCCESS) {
            slot_streams_free(b);
            shim_ctx_leave(pushed);
        }
    }
    slot_streams_forget(b); /* a fork child's are its parent's */
    r = real.cuStreamCreate(&b->stream, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS) {
        b->stream = NULL;
        cu_fail(s, NULL, "cuStreamCreate", r);
        return -1;
    }
    b->sctx = ctx;
    b->spid = getpid();
    /* Blocking sync: a worker waiting for its copy sleeps instead of spinning
     * (the context's default schedule spins while it has fewer threads than
     * CPUs), so the CPUs stay with the workers that memcpy and fault pages. */
    for (unsigned i = 0; i < shim_settings()->staging_depth; i++) {
        r = real.cuEventCreate(&b->done[i], CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING);
        if (r != CUDA_SUCCESS) {
            b->done[i] = NULL;
            slot_streams_free(b);
            cu_fail(s, NULL, "cuEventCreate", r);
            return -1;
        }
    }
    return 0;
}

static void pipe_drain(struct staging *s, struct worker *w);

/* The task's context current, with the slot's stream of it (what the
 * pipeline has in flight on another context's stream waited for first). */
static int worker_use(struct staging *s, struct worker *w, CUcontext ctx)
{
    struct bounce *b = &bounces[w->slot];
    CUresult r;
    uint64_t t0;
    int rc;

    if (w->entered && w->ctx == ctx)
        return 0;
    pipe_drain(s, w);
    worker_leave(w);
    t0 = shim_now_ns();
    r = shim_ctx_enter(ctx, &w->pushed);
    if (r != CUDA_SUCCESS) {
        cu_fail(s, NULL, "cuCtxPushCurrent", r);
        return -1;
    }
    w->entered = true;
    w->ctx = ctx;
    rc = slot_streams(s, b, ctx);
    if (rc == 0) {
        w->stream = b->stream;
        memcpy(w->done, b->done, sizeof w->done);
    }
    w->t.stream_ns += shim_now_ns() - t0;
    return rc;
}

/* Fault in the pages of a fresh anonymous range for writing, before the
 * register pins them or the copy fills them (measured on the H200, 1 GiB
 * from 16 threads: MADV_POPULATE_WRITE 42-50 GB/s, memset 37-39). An older
 * kernel answers EINVAL for the unknown advice (the range is page-aligned
 * and mapped, so EINVAL means nothing else); then one byte per page is
 * written instead: a write, or the kernel maps the shared zero page. The
 * timing line says which (staging_times.populate_how). */
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

static void copy_begin(struct staging *s)
{
    pthread_mutex_lock(&s->lock);
    if (s->copying++ == 0)
        s->copy_since = shim_now_ns();
    pthread_mutex_unlock(&s->lock);
}

static void copy_end(struct staging *s)
{
    pthread_mutex_lock(&s->lock);
    if (--s->copying == 0)
        s->t.copy_wall_ns += shim_now_ns() - s->copy_since;
    pthread_mutex_unlock(&s->lock);
}

/* SNAPSHOT_SHIM_STAGING_BOUNCE_PIN=register: a mapping of our own, written
 * through (populated, 2 MiB pages where THP allows), then registered: the
 * driver pins populated memory at ~11 GB/s where cuMemHostAlloc ran at
 * ~1.6 GB/s on the H200 (docs/benchmarks.md), and the first SAVE of a
 * process pays that pinning. */
static CUresult bounce_register(void **out, size_t size, char *why, size_t n)
{
    char msg[160];
    char *p = staging_alloc(size, msg, sizeof msg);
    CUresult r;

    if (!p) {
        snprintf(why, n, "%s", msg);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memset(p, 0, size);
    r = real.cuMemHostRegister(p, size, CU_MEMHOSTREGISTER_PORTABLE);
    if (r != CUDA_SUCCESS) {
        snprintf(why, n, "cuMemHostRegister");
        munmap(p, size);
        return r;
    }
    *out = p;
    return CUDA_SUCCESS;
}

/* The worker's bounce buffer, pinned now if it is not yet (in the current
 * context, PORTABLE so that every context may copy through it). */
static char *bounce_get(struct staging *s, struct worker *w, const struct segment *first)
{
    struct bounce *b = &bounces[w->slot];
    size_t size = shim_settings()->staging_bounce;
    bool reg = shim_settings()->staging_bounce_register;
    char why[160] = "cuMemHostAlloc";
    uint64_t t0;
    CUresult r;

    if (b->p && b->pid == getpid() && b->size == size && b->registered == reg)
        return b->p;
    if (b->p && b->pid == getpid())
        bounce_free(b); /* another size or kind (settings are read once: not seen) */
    t0 = shim_now_ns();
    r = reg ? bounce_register(&b->p, size, why, sizeof why)
            : real.cuMemHostAlloc(&b->p, size, CU_MEMHOSTALLOC_PORTABLE);
    w->t.register_ns += shim_now_ns() - t0;
    if (r != CUDA_SUCCESS) {
        b->p = NULL;
        if (r == CUDA_ERROR_OUT_OF_MEMORY && reg && strcmp(why, "cuMemHostRegister") != 0)
            stage_fail(s, first, "bounce buffer: %s", why);
        else
            cu_fail(s, first, why, r);
        return NULL;
    }
    b->size = size;
    b->pid = getpid();
    b->registered = reg;
    b->ctx = w->ctx;
    return b->p;
}

/* Where the next byte of a chunk lies: segment seg0 + i, `off` bytes in. */
struct cursor {
    uint32_t i;
    size_t off;
};

/* Queue the copies of the next `n` bytes of task `k` between the device and
 * `buf` (one copy per segment part: a piece may span several small
 * allocations), then record `done` after them. */
static int piece_dma(struct staging *s, struct worker *w, const struct task *k,
                     struct cursor *c, char *buf, size_t n, CUevent done)
{
    size_t at = 0;
    CUresult r;

    while (at < n) {
        const struct segment *sg = &s->segs[k->seg0 + c->i];
        size_t take = sg->len - c->off < n - at ? sg->len - c->off : n - at;
        r = s->to_host ? real.cuMemcpyDtoHAsync(buf + at, sg->dev + c->off, take, w->stream)
                       : real.cuMemcpyHtoDAsync(sg->dev + c->off, buf + at, take, w->stream);
        if (r != CUDA_SUCCESS) {
            cu_fail(s, sg, s->to_host ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync", r);
            return -1;
        }
        at += take;
        c->off += take;
        if (c->off == sg->len) {
            c->i++;
            c->off = 0;
        }
    }
    r = real.cuEventRecord(done, w->stream);
    if (r != CUDA_SUCCESS) {
        cu_fail(s, &s->segs[k->seg0], "cuEventRecord", r);
        return -1;
    }
    return 0;
}

static int piece_wait(struct staging *s, struct worker *w, const struct segment *seg,
                      CUevent done)
{
    uint64_t t0 = shim_now_ns();
    CUresult r = real.cuEventSynchronize(done);

    w->t.copy_ns += shim_now_ns() - t0;
    if (r != CUDA_SUCCESS) {
        cu_fail(s, seg, "cuEventSynchronize", r);
        return -1;
    }
    return 0;
}

static void timed_memcpy(struct worker *w, char *to, const char *from, size_t n)
{
    uint64_t t0 = shim_now_ns();
    memcpy(to, from, n);
    w->t.memcpy_ns += shim_now_ns() - t0;
}

/* SAVE: one chunk through the bounce buffer, cut in `depth` pieces
 * (SNAPSHOT_SHIM_STAGING_DEPTH, 2 by default: double-buffered): piece j of
 * the chunk goes through slot j % depth, so that the copy engine fills up to
 * depth - 1 pieces while this thread memcpy's another out: the copies of
 * pieces j .. j + depth - 1 are queued before piece j is memcpy'd out (that
 * memcpy faults the fresh staging pages in as it writes them, each 2 MiB
 * page zeroed just before it is written: no pass of its own). On any error
 * the stream is drained before returning: the bounce buffer is never left
 * with a copy in flight. */
static int bounce_save(struct staging *s, struct worker *w, const struct task *k)
{
    unsigned depth = shim_settings()->staging_depth;
    size_t piece = shim_settings()->staging_bounce / depth;
    char *buf = bounce_get(s, w, &s->segs[k->seg0]);
    size_t pieces, j, queued = 0;
    struct cursor c = {0, 0};
    int rc = 0;
    uint64_t t0;

    if (!buf)
        return -1;
    w->dirtied = true;
    pieces = (k->len + piece - 1) / piece;
    copy_begin(s);
    for (j = 0; j < pieces && rc == 0; j++) {
        size_t at = j * piece, n = k->len - at < piece ? k->len - at : piece;
        /* Slot q % depth is free once piece q - depth was memcpy'd out. */
        for (; queued < pieces && queued < j + depth && rc == 0; queued++) {
            size_t qat = queued * piece, qn = k->len - qat < piece ? k->len - qat : piece;
            t0 = shim_now_ns();
            rc = piece_dma(s, w, k, &c, buf + (queued % depth) * piece, qn,
                           w->done[queued % depth]);
            w->t.copy_ns += shim_now_ns() - t0;
        }
        if (rc != 0 || piece_wait(s, w, &s->segs[k->seg0], w->done[j % depth]) != 0) {
            rc = -1;
            break;
        }
        timed_memcpy(w, k->host + at, buf + (j % depth) * piece, n);
    }
    if (rc != 0) {
        /* Nothing may still write into the buffer. */
        CUresult r = real.cuStreamSynchronize(w->stream);
        if (r != CUDA_SUCCESS)
            cu_fail(s, &s->segs[k->seg0], "cuStreamSynchronize", r);
    }
    copy_end(s);
    return rc;
}

/* A chunk is done (its copies waited for, or given up after an error): the
 * queue may be idle. Called with s->lock held. */
static void task_end_locked(struct staging *s)
{
    if (--s->inflight == 0 && s->next == s->published)
        pthread_cond_broadcast(&s->idle);
}

static void task_end(struct staging *s)
{
    pthread_mutex_lock(&s->lock);
    task_end_locked(s);
    pthread_mutex_unlock(&s->lock);
}

/* LOAD: wait for the oldest piece in flight; the last piece of a chunk ends
 * the chunk, and only then are its bytes counted (the one place for LOAD). */
static int pipe_settle(struct staging *s, struct worker *w)
{
    unsigned depth = shim_settings()->staging_depth;
    unsigned q = (unsigned)((w->pipe.issued - w->pipe.busy) % depth);
    int rc = piece_wait(s, w, w->pipe.piece[q].seg, w->done[q]);

    if (rc != 0)
        return -1;
    w->pipe.piece[q].busy = false;
    w->pipe.busy--;
    if (w->pipe.piece[q].last) {
        __atomic_fetch_add(&g.phase_bytes_done, (uint64_t)w->pipe.piece[q].chunk_len,
                           __ATOMIC_RELAXED);
        w->t.chunks++;
        task_end(s);
    }
    return 0;
}

/* After an error: nothing in flight any more (the stream drained), and the
 * chunks whose last piece was queued end without being counted; a chunk
 * whose last piece was not queued is its caller's to end. */
static void pipe_abort(struct staging *s, struct worker *w)
{
    CUresult r = real.cuStreamSynchronize(w->stream);

    if (r != CUDA_SUCCESS)
        cu_fail(s, NULL, "cuStreamSynchronize", r);
    for (unsigned q = 0; q < STAGING_DEPTH_MAX; q++) {
        if (w->pipe.piece[q].busy && w->pipe.piece[q].last)
            task_end(s);
        w->pipe.piece[q].busy = false;
    }
    w->pipe.busy = 0;
    if (w->pipe.open)
        copy_end(s);
    w->pipe.open = false;
}

/* LOAD: every piece in flight waited for, before the worker sleeps, leaves
 * its context or the op. */
static void pipe_drain(struct staging *s, struct worker *w)
{
    while (w->pipe.busy)
        if (pipe_settle(s, w) != 0) {
            pipe_abort(s, w);
            return;
        }
    if (w->pipe.open)
        copy_end(s);
    w->pipe.open = false;
}

/* LOAD: one chunk through the bounce buffer, cut in `depth` pieces: piece j
 * of the worker's pipeline goes through slot j % depth, memcpy'd in once the
 * copy of piece j - depth (the same slot, maybe of the chunk before) is
 * done, then queued. Why across chunks: a chunk of 96 x 6 MiB's LOAD is 9
 * MiB, three pieces, and each chunk used to start and end its pipeline
 * empty; on one H200 (2026-12-02, commit 22e4058, docs/benchmarks.md,
 * alternated with the shim before it in one run) that LOAD ran at 34.9 and 37.6 GB/s against
 * 31.8 and 33.3, the threads' waiting 0.070-0.072 thread-s against
 * 0.089-0.101; the larger shapes, whose chunks hold 4-16 pieces, moved
 * within their spread. (SAVE's chunks stay drained one by one: a pipeline
 * across them did not move SAVE: the same day, commit c9acf2e.)
 *
 * The chunk's last copies stay in flight: 0 says its end is the pipeline's
 * (pipe_settle); -1, after an error, that nothing of the chunk is in flight
 * any more and the caller ends it. */
static int load_pipe(struct staging *s, struct worker *w, const struct task *k)
{
    unsigned depth = shim_settings()->staging_depth;
    size_t piece = shim_settings()->staging_bounce / depth;
    char *buf = bounce_get(s, w, &s->segs[k->seg0]);
    size_t pieces;
    struct cursor c = {0, 0};
    uint64_t t0;

    if (!buf)
        return -1;
    pieces = (k->len + piece - 1) / piece;
    if (!w->pipe.open)
        copy_begin(s);
    w->pipe.open = true;
    for (size_t j = 0; j < pieces; j++) {
        size_t at = j * piece, n = k->len - at < piece ? k->len - at : piece;
        unsigned q = (unsigned)(w->pipe.issued % depth);
        int rc;
        if (w->pipe.piece[q].busy && pipe_settle(s, w) != 0)
            goto fail;
        timed_memcpy(w, buf + q * piece, k->host + at, n);
        t0 = shim_now_ns();
        rc = piece_dma(s, w, k, &c, buf + q * piece, n, w->done[q]);
        w->t.copy_ns += shim_now_ns() - t0;
        if (rc != 0)
            goto fail;
        w->pipe.piece[q].busy = true;
        w->pipe.piece[q].last = j + 1 == pieces;
        w->pipe.piece[q].chunk_len = k->len;
        w->pipe.piece[q].seg = &s->segs[k->seg0];
        w->pipe.busy++;
        w->pipe.issued++;
    }
    return 0;
fail:
    pipe_abort(s, w);
    return -1;
}

/* Every segment of task k queued on the worker's stream, straight between the
 * device and the segment's host memory (pinned by the caller); the first
 * failure is recorded (cu_fail) and ends the queueing. */
static CUresult copy_segments(struct staging *s, struct worker *w, const struct task *k)
{
    CUresult r = CUDA_SUCCESS;

    for (uint32_t i = 0; i < k->nseg && r == CUDA_SUCCESS; i++) {
        const struct segment *sg = &s->segs[k->seg0 + i];
        r = s->to_host ? real.cuMemcpyDtoHAsync(sg->host, sg->dev, sg->len, w->stream)
                       : real.cuMemcpyHtoDAsync(sg->dev, sg->host, sg->len, w->stream);
        if (r != CUDA_SUCCESS)
            cu_fail(s, sg, s->to_host ? "cuMemcpyDtoHAsync" : "cuMemcpyHtoDAsync", r);
    }
    return r;
}

/* One chunk registered in place: [populate,] register, every segment's
 * copy, one sync, unregister. The registration never outlives the call,
 * whatever fails. */
static int pinned_copy(struct staging *s, struct worker *w, const struct task *k)
{
    const struct segment *first = &s->segs[k->seg0];
    CUresult r = CUDA_SUCCESS, r2;
    uint64_t t0 = shim_now_ns(), t1;

    r = real.cuMemHostRegister(k->host, k->len, 0);
    t1 = shim_now_ns();
    w->t.register_ns += t1 - t0;
    if (r != CUDA_SUCCESS) {
        cu_fail(s, first, "cuMemHostRegister", r);
        return -1;
    }
    copy_begin(s);
    r = copy_segments(s, w, k);
    /* Always drain the stream before the pages are unpinned. */
    r2 = real.cuStreamSynchronize(w->stream);
    copy_end(s);
    t0 = shim_now_ns();
    w->t.copy_ns += t0 - t1;
    if (r2 != CUDA_SUCCESS && r == CUDA_SUCCESS) {
        cu_fail(s, first, "cuStreamSynchronize", r2);
        r = r2;
    }
    r2 = real.cuMemHostUnregister(k->host);
    w->t.unregister_ns += shim_now_ns() - t0;
    if (r2 != CUDA_SUCCESS && r == CUDA_SUCCESS) {
        cu_fail(s, first, "cuMemHostUnregister", r2);
        r = r2;
    }
    return r == CUDA_SUCCESS ? 0 : -1;
}

/* One chunk between the device and a kept host copy (pinned for good): every
 * segment's copy straight into or out of it, then one wait. A LOAD's bounce
 * pipeline is drained first: its events are the slot's. */
static int direct_copy(struct staging *s, struct worker *w, const struct task *k)
{
    CUresult r = CUDA_SUCCESS;
    uint64_t t0;

    pipe_drain(s, w);
    if (has_failed(s))
        return -1;
    t0 = shim_now_ns();
    copy_begin(s);
    r = copy_segments(s, w, k);
    if (r == CUDA_SUCCESS && (r = real.cuEventRecord(w->done[0], w->stream)) != CUDA_SUCCESS)
        cu_fail(s, &s->segs[k->seg0], "cuEventRecord", r);
    if (r == CUDA_SUCCESS && (r = real.cuEventSynchronize(w->done[0])) != CUDA_SUCCESS)
        cu_fail(s, &s->segs[k->seg0], "cuEventSynchronize", r);
    if (r != CUDA_SUCCESS && real.cuStreamSynchronize(w->stream) != CUDA_SUCCESS)
        shim_log(LOG_WARN, "cuStreamSynchronize after a failed copy failed");
    copy_end(s);
    w->t.copy_ns += shim_now_ns() - t0;
    return r == CUDA_SUCCESS ? 0 : -1;
}

/* SNAPSHOT_SHIM_STAGING_PREFAULT, a test hook (shim.h): false in a release
 * build, whose settings have no such field. */
static bool prefault_hook(void)
{
#ifdef CUINTERPOSE_TEST_HOOKS
    return shim_settings()->staging_prefault;
#else
    return false;
#endif
}

/* One chunk, either way; its bytes are accounted here, or, for a LOAD
 * through the bounce buffers, when its last copy is waited for
 * (pipe_settle). True when the chunk's end is the pipeline's. */
static bool run_copy(struct staging *s, struct worker *w, const struct task *k)
{
    uint64_t t0;
    int rc;

    if (worker_use(s, w, k->ctx) != 0)
        return false;
    if (k->direct) {
        if (direct_copy(s, w, k) != 0)
            return false;
        __atomic_fetch_add(&g.phase_bytes_done, (uint64_t)k->len, __ATOMIC_RELAXED);
        w->t.chunks++;
        return false;
    }
    if (!s->to_host && shim_settings()->staging_bounce)
        return load_pipe(s, w, k) == 0;
    /* Through the bounce buffers the memcpy faults the pages in; only a
     * registration in place (or SNAPSHOT_SHIM_STAGING_PREFAULT=1) needs them
     * populated first. */
    if (s->to_host && !s->populated &&
        (!shim_settings()->staging_bounce || prefault_hook())) {
        t0 = shim_now_ns();
        if (populate(k->host, k->len) != 0) {
            int e = errno;
            stage_fail(s, &s->segs[k->seg0],
                       "madvise(MADV_POPULATE_WRITE) failed: %s (errno %d)", strerror(e), e);
            return false;
        }
        w->t.populate_ns += shim_now_ns() - t0;
    }
    rc = shim_settings()->staging_bounce ? bounce_save(s, w, k) : pinned_copy(s, w, k);
    if (rc != 0)
        return false;
    __atomic_fetch_add(&g.phase_bytes_done, (uint64_t)k->len, __ATOMIC_RELAXED);
    w->t.chunks++;
    return false;
}

/* Give the pages of a staged copy back to the kernel (the mapping itself is
 * unmapped by its owner): MADV_DONTNEED takes the mm lock for reading, so
 * the workers free in parallel where munmap would serialize. */
static void run_release(struct worker *w, const struct task *k)
{
    uint64_t t0 = shim_now_ns();
    if (madvise(k->host, k->len, MADV_DONTNEED) != 0)
        shim_log(LOG_WARN, "madvise(MADV_DONTNEED) of staged bytes failed: %s",
                 strerror(errno));
    w->t.release_ns += shim_now_ns() - t0;
}

/* Wait, bounded, until the populate thread on task i leaves it; on timeout
 * the op fails naming the chunk (the copy is then skipped: the populate
 * thread may still write into it). Called with s->lock held. */
static void await_populated(struct staging *s, uint32_t i)
{
    struct timespec until;
    int e = 0;

    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += POPULATE_WAIT_S;
    while (s->tasks[i].pop == POP_BUSY && e == 0)
        e = pthread_cond_timedwait(&s->popped, &s->lock, &until);
    if (s->tasks[i].pop == POP_BUSY)
        stage_fail(s, &s->segs[s->tasks[i].seg0],
                   "chunk %u (%zu bytes) still being populated ahead: waited up to %d s (%s)",
                   i, s->tasks[i].len, POPULATE_WAIT_S, strerror(e));
}

/* Take one published task and run it; false when none is ready. Called
 * with s->lock held; returns with it held. */
static bool take_one(struct staging *s, struct worker *w)
{
    struct task k;
    uint32_t i;
    bool deferred = false;

    if (s->next == s->published)
        return false;
    /* Claimed before any wait: a thread that waited on the queue's head
     * while another took it would otherwise go on past what is published
     * (the hang seen on the H200: next beyond published, never drained). */
    i = s->next++;
    s->inflight++;
    /* A populate thread halfway through this chunk finishes it first; one
     * not there yet leaves it to the memcpy. */
    if (s->tasks[i].pop == POP_NONE)
        s->tasks[i].pop = POP_COPYING;
    else if (s->tasks[i].pop == POP_BUSY)
        await_populated(s, i);
    k = s->tasks[i];
    pthread_mutex_unlock(&s->lock);
    if (!has_failed(s)) {
        if (k.kind == TASK_COPY)
            deferred = run_copy(s, w, &k);
        else
            run_release(w, &k);
    }
    pthread_mutex_lock(&s->lock);
    if (!deferred)
        task_end_locked(s);
    return true;
}

static void worker_done(struct staging *s, struct worker *w)
{
    worker_leave(w);
    pthread_mutex_lock(&s->lock);
    s->t.populate_ns += w->t.populate_ns;
    s->t.register_ns += w->t.register_ns;
    s->t.copy_ns += w->t.copy_ns;
    s->t.unregister_ns += w->t.unregister_ns;
    s->t.release_ns += w->t.release_ns;
    s->t.memcpy_ns += w->t.memcpy_ns;
    s->t.stream_ns += w->t.stream_ns;
    s->t.chunks += w->t.chunks;
    pthread_mutex_unlock(&s->lock);
}

static void *pool_worker(void *arg)
{
    struct staging *s = arg;
    struct worker w;

    memset(&w, 0, sizeof w);
    pthread_mutex_lock(&s->lock);
    w.slot = s->slots++;
    for (;;) {
        if (take_one(s, &w))
            continue;
        if (w.pipe.busy) { /* nothing queued: finish what is in flight first */
            pthread_mutex_unlock(&s->lock);
            pipe_drain(s, &w);
            pthread_mutex_lock(&s->lock);
            continue;
        }
        if (s->closing)
            break;
        pthread_cond_wait(&s->more, &s->lock);
    }
    pthread_mutex_unlock(&s->lock);
    worker_done(s, &w);
    return NULL;
}

static void *pool_populator(void *arg)
{
    struct staging *s = arg;
    uint64_t spent = 0;

    pthread_mutex_lock(&s->lock);
    for (;;) {
        struct task k;
        uint32_t i;
        uint64_t t0;
        int rc;

        if (s->ahead_next < s->next)
            s->ahead_next = s->next; /* taken: the copy faults those itself */
        if (s->ahead_next == s->published) {
            if (s->closing)
                break;
            pthread_cond_wait(&s->ahead_more, &s->lock);
            continue;
        }
        i = s->ahead_next++;
        if (s->tasks[i].kind != TASK_COPY || s->tasks[i].pop != POP_NONE || has_failed(s))
            continue;
        /* No copy thread has taken it: nothing else writes into it meanwhile. */
        s->tasks[i].pop = POP_BUSY;
        k = s->tasks[i];
        pthread_mutex_unlock(&s->lock);
        t0 = shim_now_ns();
        rc = populate(k.host, k.len);
        if (rc != 0) {
            int e = errno;
            stage_fail(s, &s->segs[k.seg0],
                       "populating chunk %u ahead: madvise(MADV_POPULATE_WRITE) failed: %s "
                       "(errno %d)",
                       i, strerror(e), e);
        }
        spent += shim_now_ns() - t0;
        pthread_mutex_lock(&s->lock);
        if (rc == 0)
            s->t.populated_chunks++;
        s->tasks[i].pop = POP_DONE; /* failed or not: its waiter must not wait on */
        pthread_cond_broadcast(&s->popped);
    }
    s->t.populate_ns += spent;
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* ------------------------------------------------------------ the pool */
/* Chunks per copy thread by default. SAVE memcpy's into fresh pages, whose
 * cost varies from page to page: smaller chunks balance the threads. On the
 * H200 (2026-12-02, commit 982e90e, docs/benchmarks.md; in the order 8, 4,
 * 8 in one process): 96 x 6 MiB SAVE 26.7 and 28.2 GB/s with 8 against
 * 24.3 with 4; 100 x 20 MiB the same within noise. LOAD keeps 4: 100 x 20
 * MiB loaded at 41.9-43.1 GB/s with 4 against 40.0 with 8. */
#define SAVE_SPREAD 8u
#define LOAD_SPREAD 4u

/* Chunk size for a phase of `total` bytes: the setting, but small enough
 * that every thread gets about `spread` chunks
 * (SNAPSHOT_SHIM_STAGING_CHUNKS_PER_THREAD, else the defaults above: 96
 * allocations of 6 MiB would otherwise be 9 chunks of 64 MiB for 16
 * threads), never below 1 MiB. Fewer, longer chunks fill each thread's bounce pipeline fewer times (its first
 * copy and last memcpy overlap nothing); more balance the threads' work. */
static size_t pick_chunk(uint64_t total, unsigned threads, unsigned spread, size_t setting)
{
    uint64_t even = total / ((uint64_t)threads * spread) >> 20 << 20;
    size_t floor = (size_t)1 << 20;
    if (even < floor)
        even = floor;
    return even < setting ? (size_t)even : setting;
}

/* At most how many more tasks task_cap's tail makes than chunks of `chunk`:
 * while it shrinks, each task takes at least half of 1/threads of what
 * remains (the share is rounded down to a MiB, and is at least one), so
 * every 2 x threads tasks at least halve what remains, from threads x chunk
 * down to threads x 1 MiB; below that, tasks of 1 MiB, at most `threads`.
 * Each may cut one more segment. */
static uint64_t tail_bound(size_t chunk, unsigned threads)
{
    unsigned halvings = 1;

    for (size_t c = chunk / STAGING_TAIL_MIN; c > 1; c >>= 1)
        halvings++;
    return 2 * (uint64_t)threads * halvings + threads;
}

struct staging *staging_start(bool to_host, bool populated, uint64_t total, uint32_t items,
                              char *msg, size_t n)
{
    const struct shim_settings *cfg = shim_settings();
    struct staging *s;
    uint64_t pieces, want;
    sigset_t all, old;
    pthread_condattr_t mono;
    uint64_t t0 = shim_now_ns();

    if (!shim_resolve_host_register() || !real.cuStreamCreate || !real.cuStreamSynchronize ||
        !real.cuStreamDestroy || !real.cuMemcpyDtoHAsync || !real.cuMemcpyHtoDAsync ||
        !real.cuMemHostAlloc || !real.cuEventCreate || !real.cuEventRecord ||
        !real.cuEventSynchronize || !real.cuEventDestroy) {
        snprintf(msg, n, "the driver lacks cuMemHostRegister/cuMemHostUnregister, "
                         "cuMemHostAlloc or the stream and event entry points");
        return NULL;
    }
    s = calloc(1, sizeof *s);
    if (!s)
        goto oom;
    s->to_host = to_host;
    s->populated = populated;
    s->total = total;
    s->t.spread = cfg->staging_spread ? cfg->staging_spread
                                      : to_host ? SAVE_SPREAD : LOAD_SPREAD;
    s->chunk = pick_chunk(total, cfg->copy_threads, s->t.spread, cfg->copy_chunk);
    /* Every chunk boundary cuts at most one segment, every item starts at
     * most one task. The release tasks that follow the copies are at most a
     * chunk each over the items' host slices (each its size rounded up to a
     * page, a chunk at least 1 MiB): no more than `pieces` + `items`. LOAD's
     * shrinking last chunks add at most tail_bound tasks. */
    pieces = total / s->chunk + 2 * (uint64_t)items + 2 +
             (to_host ? 0 : tail_bound(s->chunk, cfg->copy_threads));
    if (pieces > UINT32_MAX / 3)
        goto oom;
    s->cap_segs = (uint32_t)pieces;
    s->cap_tasks = (uint32_t)(2 * pieces + items);
    s->segs = calloc(s->cap_segs, sizeof *s->segs);
    s->tasks = calloc(s->cap_tasks, sizeof *s->tasks);
    s->tids = calloc(cfg->copy_threads, sizeof *s->tids);
    s->helpers = calloc(cfg->staging_ahead ? cfg->staging_ahead : 1, sizeof *s->helpers);
    if (!s->segs || !s->tasks || !s->tids || !s->helpers)
        goto oom;
    /* The bounded wait on `popped` must not move with the wall clock. */
    if (pthread_condattr_init(&mono) != 0)
        goto oom;
    if (pthread_condattr_setclock(&mono, CLOCK_MONOTONIC) != 0 ||
        pthread_mutex_init(&s->lock, NULL) != 0) {
        pthread_condattr_destroy(&mono);
        goto oom;
    }
    pthread_cond_init(&s->more, NULL);
    pthread_cond_init(&s->idle, NULL);
    pthread_cond_init(&s->ahead_more, NULL);
    pthread_cond_init(&s->popped, &mono);
    pthread_condattr_destroy(&mono);
    /* No more threads than chunks. */
    want = (total + s->chunk - 1) / s->chunk;
    if (want > cfg->copy_threads)
        want = cfg->copy_threads;
    /* Workers take no signals, like the control thread: the application's
     * handlers run on its own threads. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (; s->started < want; s->started++) {
        int e = pthread_create(&s->tids[s->started], NULL, pool_worker, s);
        if (e != 0) { /* fewer workers: the queue is shared, so still correct */
            shim_log(LOG_WARN, "pthread_create failed (%s): staging with %u threads",
                     strerror(e), s->started);
            break;
        }
    }
    /* Only into fresh memory, and only while copy threads run: with none
     * the control thread copies alone and nothing would stop the helpers. */
    if (to_host && !populated && s->started)
        for (; s->nhelpers < cfg->staging_ahead; s->nhelpers++) {
            int e = pthread_create(&s->helpers[s->nhelpers], NULL, pool_populator, s);
            if (e != 0) { /* the memcpy faults what no helper did */
                shim_log(LOG_WARN, "pthread_create failed (%s): %u populate threads",
                         strerror(e), s->nhelpers);
                break;
            }
        }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    s->plan_populate = to_host && !populated &&
                       (s->nhelpers || !cfg->staging_bounce || prefault_hook());
    s->t.threads = s->started;
    s->t.chunk = s->chunk;
    s->t.pool_start_ns = shim_now_ns() - t0;
    return s;
oom:
    if (s) {
        free(s->segs);
        free(s->tasks);
        free(s->tids);
        free(s->helpers);
        free(s);
    }
    snprintf(msg, n, "out of memory for the staging queue (%llu bytes, %u allocations)",
             (unsigned long long)total, items);
    return NULL;
}

/* The size of the next task. LOAD's last chunks shrink (guided
 * scheduling): once less than a chunk per thread remains to be queued, each
 * new one takes about 1/threads of what remains, at least 1 MiB, so that
 * the threads finish together and the op does not wait for one thread's
 * last large chunk (one H200, 2026-12-02, commit c53ba93: the copies
 * left after the last re-creation, the drain, took 9.6-12 ms of a LOAD of
 * 2048 x 2 MiB, 0.4-0.6 ms with it). SAVE's chunks are small throughout. */
static size_t task_cap(const struct staging *s)
{
    uint64_t share;

    if (s->to_host || s->started < 2)
        return s->chunk;
    share = (s->total - s->added) / s->started >> 20 << 20;
    if (share < STAGING_TAIL_MIN)
        share = STAGING_TAIL_MIN;
    return share < s->chunk ? (size_t)share : s->chunk;
}

static void publish(struct staging *s)
{
    if (!s->open)
        return;
    s->open = false;
    pthread_mutex_lock(&s->lock);
    s->published = ++s->ntasks;
    pthread_cond_signal(&s->more);
    if (s->nhelpers)
        pthread_cond_broadcast(&s->ahead_more);
    pthread_mutex_unlock(&s->lock);
}

int staging_add(struct staging *s, const struct obj *o, char *host, CUdeviceptr dev,
                CUcontext ctx)
{
    return staging_add_range(s, o, host, dev, ctx, 0, o->size, false);
}

int staging_add_range(struct staging *s, const struct obj *o, char *host, CUdeviceptr dev,
                      CUcontext ctx, size_t offset, size_t len, bool direct)
{
    size_t done = 0;

    while (done < len) {
        struct task *k = &s->tasks[s->ntasks];
        size_t take;

        if (s->open &&
            (k->host + k->len != host + done || k->ctx != ctx || k->direct != direct))
            publish(s);
        k = &s->tasks[s->ntasks];
        if (!s->open) {
            if (s->ntasks == s->cap_tasks || s->nsegs == s->cap_segs)
                return -1; /* cannot happen: the bound above */
            memset(k, 0, sizeof *k);
            k->kind = TASK_COPY;
            k->host = host + done;
            k->seg0 = s->nsegs;
            k->ctx = ctx;
            k->cap = task_cap(s);
            k->direct = direct;
            /* nothing to fault in: populate threads pass it by */
            k->pop = direct ? POP_DONE : POP_NONE;
            s->open = true;
        }
        if (s->nsegs == s->cap_segs)
            return -1;
        take = len - done;
        if (take > k->cap - k->len)
            take = k->cap - k->len;
        s->segs[s->nsegs++] =
            (struct segment){host + done, dev + done, take, o, offset + done};
        k->nseg++;
        k->len += take;
        done += take;
        s->added += take;
        if (k->len == k->cap)
            publish(s);
    }
    return 0;
}

/* A staged copy's pages given back in chunk-sized tasks, so that the workers
 * free a large allocation in parallel: one 8 GiB madvise on one thread was
 * most of an 8 GiB LOAD's teardown on the H200 (38 of 226 ms). */
int staging_release(struct staging *s, char *host, size_t len)
{
    publish(s);
    while (len > 0) {
        size_t piece = len < s->chunk ? len : s->chunk;
        struct task *k;

        if (s->ntasks == s->cap_tasks)
            return -1;
        k = &s->tasks[s->ntasks];
        memset(k, 0, sizeof *k);
        k->kind = TASK_RELEASE;
        k->host = host;
        k->len = piece;
        s->open = true;
        publish(s);
        host += piece;
        len -= piece;
    }
    return 0;
}

int staging_wait(struct staging *s, char *msg, size_t n)
{
    struct worker w;

    publish(s);
    memset(&w, 0, sizeof w);
    pthread_mutex_lock(&s->lock);
    /* With no worker started (pthread_create failed) the control thread does
     * it all, with slot 0; otherwise it only waits, so that the same slots,
     * and so the same bounce buffers, serve every op. */
    while (s->started == 0 && take_one(s, &w))
        ;
    if (w.pipe.busy) {
        pthread_mutex_unlock(&s->lock);
        pipe_drain(s, &w);
        pthread_mutex_lock(&s->lock);
    }
    while (s->inflight > 0 || s->next != s->published)
        pthread_cond_wait(&s->idle, &s->lock);
    pthread_mutex_unlock(&s->lock);
    worker_done(s, &w);
    if (has_failed(s)) {
        snprintf(msg, n, "%s", s->msg);
        return -1;
    }
    return 0;
}

void staging_stop(struct staging *s, struct staging_times *t)
{
    pthread_mutex_lock(&s->lock);
    s->closing = true;
    pthread_cond_broadcast(&s->more);
    pthread_cond_broadcast(&s->ahead_more);
    pthread_mutex_unlock(&s->lock);
    for (unsigned i = 0; i < s->started; i++)
        pthread_join(s->tids[i], NULL);
    for (unsigned i = 0; i < s->nhelpers; i++)
        pthread_join(s->helpers[i], NULL);
    if (s->plan_populate)
        s->t.populate_how = __atomic_load_n(&no_populate, __ATOMIC_RELAXED)
                                ? STAGING_POPULATE_TOUCH
                                : STAGING_POPULATE_MADVISE;
    if (t)
        *t = s->t;
    pthread_cond_destroy(&s->more);
    pthread_cond_destroy(&s->idle);
    pthread_cond_destroy(&s->ahead_more);
    pthread_cond_destroy(&s->popped);
    pthread_mutex_destroy(&s->lock);
    free(s->segs);
    free(s->tasks);
    free(s->tids);
    free(s->helpers);
    free(s);
}
