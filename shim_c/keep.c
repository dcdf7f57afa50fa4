/*
 * The kept host copy (SNAPSHOT_SHIM_KEEP_HOST_COPY=1; specs/shim.md, "Kept
 * host copy").
 *
 * Why: a SAVE into fresh staging memory is held by the kernel zeroing each
 * page before the copy writes it, and by the bounce buffers' memcpy (SAVE at
 * 0.48 of the DtoH ceiling on the H200, docs/benchmarks.md); and a process
 * put to sleep and woken many times a day mostly holds the same bytes every
 * time (the weights). So, in this mode, every allocation SAVE moves has a
 * host copy of its own, pinned once (cuMemHostAlloc, or a populated mapping
 * cuMemHostRegister'd with SNAPSHOT_SHIM_STAGING_BOUNCE_PIN=register) and kept
 * for as long as the allocation lives: SAVE and LOAD copy straight between
 * the device and it, and SAVE copies only the chunks whose hash differs from
 * the one of what the copy holds (content.c).
 *
 * Made ahead: a thread of the shim's looks at the allocation table every
 * KEEP_TICK_MS while the application runs (only when it changed: g.objs_gen)
 * and pins a copy for each new allocation, frees the copy of each one gone;
 * SAVE does what is left itself (keep_begin), so even the first suspend finds
 * them pinned when the application ran long enough, and never lacks one.
 * The table is the keeper's and the ops' in turn (`run`); the totals are
 * atomics for STATUS.
 *
 * The hash: keephash.h (128 bits a 2 MiB chunk), computed on the GPU by the
 * kernel whose PTX the shim carries (keep_hash_ptx.h, from
 * kernels/keep_hash.cu), JIT-compiled by the driver on the first SAVE of
 * each context. A driver that cannot load or run it gets a SAVE that copies
 * everything, and the reason in the reply and the log (keep_hash's `why`).
 */
#include "shim.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "keephash.h"
#include "keep_hash_ptx.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* How often the keeper looks at the table: pinning is seconds for tens of
 * GiB, a look at an unchanged table two loads under g.lock. */
#define KEEP_TICK_MS 50
/* Contexts whose module is kept (one per device in practice). */
#define KEEP_CTXS 16

typedef CUresult (*module_load_fn)(CUmodule *, const void *);
typedef CUresult (*module_fn_fn)(CUfunction *, CUmodule, const char *);
typedef CUresult (*module_unload_fn)(CUmodule);
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void **, void **);

/* The hash kernel of one context, loaded on first use. */
struct keep_fn {
    CUcontext ctx;
    pid_t pid;
    CUmodule mod;
    CUfunction fn;
    CUstream stream;
    CUdeviceptr out;            /* two words a chunk, for one SAVE's chunks */
    size_t out_len;
};

static struct {
    pthread_mutex_t run;        /* the table: the keeper or an op, one at a time */
    pid_t pid;                  /* the process the table and the thread are of */
    struct keep_copy **v;
    uint32_t n, cap;
    uint64_t seen_gen;
    bool thread;                /* the keeper runs (in `pid`) */
    bool look;                  /* look again even if the table did not move */
    uint64_t bytes, count;      /* atomics: pinned bytes and copies, for STATUS */
    struct keep_fn fns[KEEP_CTXS];
    module_load_fn load;
    module_fn_fn get;
    module_unload_fn unload;
    launch_fn launch;
    bool resolved;
} K = {.run = PTHREAD_MUTEX_INITIALIZER};

/* The mode: SNAPSHOT_SHIM_KEEP_HOST_COPY until a HOST_COPY request says
 * otherwise (-1: not asked yet). */
static int asked = -1;

bool keep_enabled(void)
{
    int a = __atomic_load_n(&asked, __ATOMIC_ACQUIRE);
    return a < 0 ? shim_settings()->keep_host_copy : a == 1;
}

void keep_status(uint64_t *bytes, uint64_t *count, uint64_t *overhead)
{
    *bytes = __atomic_load_n(&K.bytes, __ATOMIC_RELAXED);
    *count = __atomic_load_n(&K.count, __ATOMIC_RELAXED);
    /* the hash tables, at most: 16 bytes a chunk of each copy, its last one short */
    *overhead = (*bytes / KH_CHUNK + *count) * 16;
}

/* ------------------------------------------------------------ pinning */
static void account(const struct keep_copy *c, int sign)
{
    if (sign > 0) {
        __atomic_fetch_add(&K.bytes, (uint64_t)c->len, __ATOMIC_RELAXED);
        __atomic_fetch_add(&K.count, 1, __ATOMIC_RELAXED);
    } else {
        __atomic_fetch_sub(&K.bytes, (uint64_t)c->len, __ATOMIC_RELAXED);
        __atomic_fetch_sub(&K.count, 1, __ATOMIC_RELAXED);
    }
}

/* A field of /proc/meminfo in bytes, or -1. */
static long long meminfo(const char *field)
{
    char line[256];
    size_t n = strlen(field);
    long long kib = -1;
    FILE *f = fopen("/proc/meminfo", "re");

    if (!f)
        return -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') {
            kib = strtoll(line + n + 1, NULL, 10);
            break;
        }
    fclose(f);
    return kib < 0 ? -1 : kib * 1024;
}

/* Pinned memory cannot be swapped or reclaimed: a copy is pinned only while
 * the host keeps KEEP_RESERVE_DIV-th of its memory (at least 1 GiB) available
 * after it, so that the mode never takes the last of the host's memory from
 * the application and its neighbours; past that its allocation goes through
 * the staging memory and the SAVE says why. */
#define KEEP_RESERVE_DIV 16
static bool room_for(size_t len, char *why, size_t n)
{
#ifdef CUINTERPOSE_TEST_HOOKS
    size_t hook = shim_settings()->test_host_available;
#else
    size_t hook = 0;
#endif
    long long avail = hook ? (long long)hook : meminfo("MemAvailable");
    long long total = hook ? (long long)hook : meminfo("MemTotal");
    long long reserve = total / KEEP_RESERVE_DIV;

    if (avail < 0 || total < 0)
        return true; /* no /proc: the driver's own refusal is the bound */
    if (reserve < (1ll << 30))
        reserve = 1ll << 30;
    if (avail - (long long)len >= reserve)
        return true;
    snprintf(why, n, "pinning %zu bytes would leave %lld of the host's %lld bytes available, "
             "less than the %lld the kept host copy leaves free", len, avail - (long long)len,
             total, reserve);
    return false;
}

/* Pin `c` in its context: c->host, or c->why. */
static void pin(struct keep_copy *c)
{
    bool reg = shim_settings()->staging_bounce_register;
    bool pushed;
    void *p = NULL;
    CUresult r;

    c->why[0] = 0;
    if (!room_for(c->len, c->why, sizeof c->why)) {
        shim_log(LOG_WARN, "kept host copy not pinned (its allocation goes through the staging "
                 "memory): %s", c->why);
        return;
    }
    r = shim_ctx_enter(c->ctx, &pushed);
    if (r != CUDA_SUCCESS) {
        snprintf(c->why, sizeof c->why, "cuCtxPushCurrent failed: %s", shim_cu_name(r));
        return;
    }
    if (!reg) {
        r = real.cuMemHostAlloc(&p, c->len, CU_MEMHOSTALLOC_PORTABLE);
        if (r != CUDA_SUCCESS)
            snprintf(c->why, sizeof c->why, "cuMemHostAlloc of %zu bytes failed: %s", c->len,
                     shim_cu_name(r));
    } else if (!shim_resolve_host_register()) {
        snprintf(c->why, sizeof c->why, "the driver lacks cuMemHostRegister");
    } else {
        char msg[160];
        p = staging_alloc(c->len, msg, sizeof msg);
        if (!p)
            snprintf(c->why, sizeof c->why, "%s", msg);
        else if (madvise(p, c->len, MADV_POPULATE_WRITE) != 0 && errno != EINVAL)
            snprintf(c->why, sizeof c->why, "madvise(MADV_POPULATE_WRITE) of %zu bytes failed: "
                     "%s", c->len, strerror(errno));
        else if ((r = real.cuMemHostRegister(p, c->len, CU_MEMHOSTREGISTER_PORTABLE)) !=
                 CUDA_SUCCESS)
            snprintf(c->why, sizeof c->why, "cuMemHostRegister of %zu bytes failed: %s",
                     c->len, shim_cu_name(r));
        if (c->why[0] && p) {
            munmap(p, c->len);
            p = NULL;
        }
    }
    shim_ctx_leave(pushed);
    if (c->why[0]) {
        shim_log(LOG_WARN, "kept host copy not pinned (its allocation goes through the staging "
                 "memory): %s", c->why);
        return;
    }
    c->host = p;
    c->registered = reg;
    c->pid = getpid();
    c->valid = false;
    account(c, 1);
}

static void unpin(struct keep_copy *c)
{
    bool pushed;
    CUresult r;

    if (!c->host)
        return;
    account(c, -1);
    if (c->pid == getpid() && shim_ctx_enter(c->ctx, &pushed) == CUDA_SUCCESS) {
        if (c->registered) {
            r = real.cuMemHostUnregister(c->host);
            if (r != CUDA_SUCCESS)
                shim_log(LOG_WARN, "cuMemHostUnregister of a kept host copy failed: %s",
                         shim_cu_name(r));
        } else if ((r = real.cuMemFreeHost(c->host)) != CUDA_SUCCESS) {
            shim_log(LOG_WARN, "cuMemFreeHost of a kept host copy failed: %s", shim_cu_name(r));
        }
        shim_ctx_leave(pushed);
    }
    /* A registered copy is our own mapping: unmapped whether or not its context
     * could be entered to unregister it (one gone takes its registrations along). */
    if (c->pid == getpid() && c->registered && munmap(c->host, c->len) != 0)
        shim_log(LOG_WARN, "munmap of a kept host copy failed: %s", strerror(errno));
    c->host = NULL;
    c->valid = false;
}

static void copy_free(struct keep_copy *c)
{
    unpin(c);
    free(c->hash);
    free(c);
}

/* ------------------------------------------------------------ the table */
static struct keep_copy *find(const uint8_t id[CUIP_ID_LEN])
{
    for (uint32_t i = 0; i < K.n; i++)
        if (!memcmp(K.v[i]->id, id, CUIP_ID_LEN))
            return K.v[i];
    return NULL;
}

/* A fork child's table is its parent's: forgotten (the pinned memory is the
 * parent's driver state), with the totals. Under `run`. */
static void own_table(void)
{
    if (K.pid == getpid())
        return;
    for (uint32_t i = 0; i < K.n; i++) {
        free(K.v[i]->hash);
        free(K.v[i]);
    }
    free(K.v);
    K.v = NULL;
    K.n = K.cap = 0;
    K.bytes = K.count = 0;
    K.thread = false;
    K.look = true;
    memset(K.fns, 0, sizeof K.fns);
    K.pid = getpid();
}

/* What the table should hold, taken under g.lock: every allocation SAVE
 * moves that is live (a new copy is pinned for it) or not (torn down
 * between SAVE and LOAD: its copy holds its bytes), and no other. New
 * entries are added unpinned; gone ones are moved to the end, past the
 * returned count, for the caller to free without g.lock. Under `run`. */
static uint32_t plan(void)
{
    uint32_t keep_n = 0;

    for (uint32_t i = 0; i < K.n; i++)
        K.v[i]->seen = false;
    for (uint32_t i = 0; i < obj_count(); i++) {
        const struct obj *o = obj_at(i);
        struct keep_copy *c;
        if (!o || !obj_staged(o) || o->size == 0)
            continue;
        c = find(o->id);
        if (c) {
            c->seen = true;
            continue;
        }
        if (!o->live)
            continue;
        if (K.n == K.cap) {
            uint32_t nc = K.cap ? 2 * K.cap : 64;
            struct keep_copy **nv = realloc(K.v, nc * sizeof *nv);
            if (!nv)
                continue; /* the next look, or SAVE, tries again; the others are seen */
            K.v = nv;
            K.cap = nc;
        }
        c = calloc(1, sizeof *c);
        if (!c)
            continue;
        memcpy(c->id, o->id, CUIP_ID_LEN);
        c->size = o->size;
        c->len = staging_len(o->size);
        c->ctx = o->ctx;
        c->seen = true;
        K.v[K.n++] = c;
    }
    /* gone ones to the end */
    for (uint32_t i = 0; i < K.n; i++)
        if (K.v[i]->seen) {
            struct keep_copy *t = K.v[keep_n];
            K.v[keep_n++] = K.v[i];
            K.v[i] = t;
        }
    return keep_n;
}

/* Under `run`: bring the table in line with the allocations, pinning what
 * lacks a copy (`retry`: also those whose pin failed before). */
static void reconcile(bool retry)
{
    uint32_t keep_n;

    pthread_mutex_lock(&g.lock);
    K.seen_gen = g.objs_gen;
    keep_n = plan();
    pthread_mutex_unlock(&g.lock);
    for (uint32_t i = keep_n; i < K.n; i++)
        copy_free(K.v[i]);
    K.n = keep_n;
    for (uint32_t i = 0; i < K.n; i++)
        if (!K.v[i]->host && (retry || !K.v[i]->tried)) {
            K.v[i]->tried = true;
            pin(K.v[i]);
        }
}

static struct keep_fn *kernel_of(CUcontext ctx, char *why, size_t n);
static bool resolve_module_api(char *why, size_t n);

/* The keeper loads the hash kernel of each context that holds copies, so
 * that the driver's JIT compilation is not the first SAVE's to wait for; a
 * failure here is only logged at debug level (the SAVE tries again and says
 * why). Under `run`. */
static void preload_kernels(void)
{
    char why[200];

    if (!resolve_module_api(why, sizeof why))
        return;
    for (uint32_t i = 0; i < K.n; i++) {
        bool pushed, first = true;
        for (uint32_t j = 0; j < i; j++)
            if (K.v[j]->ctx == K.v[i]->ctx)
                first = false;
        if (!first || !K.v[i]->host || shim_ctx_enter(K.v[i]->ctx, &pushed) != CUDA_SUCCESS)
            continue;
        if (!kernel_of(K.v[i]->ctx, why, sizeof why))
            shim_log(LOG_DEBUG, "the hash kernel did not load ahead: %s", why);
        shim_ctx_leave(pushed);
    }
}

static void *keeper(void *arg)
{
    (void)arg;
    for (;;) {
        struct timespec d = {0, KEEP_TICK_MS * 1000000L};
        bool due;

        nanosleep(&d, NULL);
        if (pthread_mutex_trylock(&K.run) != 0)
            continue; /* an op has the table */
        if (K.pid != getpid()) { /* cannot be: a fork child has no keeper */
            pthread_mutex_unlock(&K.run);
            return NULL;
        }
        pthread_mutex_lock(&g.lock);
        due = keep_enabled() && g.phase == CUIP_PHASE_ACTIVE && !g.busy &&
              (g.objs_gen != K.seen_gen || K.look);
        pthread_mutex_unlock(&g.lock);
        if (due) {
            K.look = false;
            reconcile(false);
            preload_kernels();
        }
        pthread_mutex_unlock(&K.run);
    }
    return NULL;
}

void keep_start(void)
{
    sigset_t all, old;
    pthread_attr_t at;
    pthread_t t;
    int e;

    if (!keep_enabled())
        return;
    pthread_mutex_lock(&K.run);
    own_table();
    if (!K.thread) {
        sigfillset(&all); /* the application's handlers run on its own threads */
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        e = pthread_create(&t, &at, keeper, NULL);
        pthread_attr_destroy(&at);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (e == 0)
            K.thread = true;
        else
            shim_log(LOG_WARN, "cannot start the thread that pins the kept host copies (%s): "
                     "the first SAVE pins them", strerror(e));
    }
    pthread_mutex_unlock(&K.run);
}

void keep_after_fork(void)
{
    /* the keeper may have held it at the fork: the child has no keeper */
    pthread_mutex_init(&K.run, NULL);
    K.thread = false;
}

int keep_begin(void)
{
    if (!keep_enabled())
        return -1;
    pthread_mutex_lock(&K.run);
    own_table();
    reconcile(true);
    return 0;
}

void keep_end(void)
{
    K.look = true; /* after a LOAD: pin again what was given back meanwhile */
    pthread_mutex_unlock(&K.run);
}

struct keep_copy *keep_of(const struct obj *o)
{
    return keep_enabled() && K.pid == getpid() ? find(o->id) : NULL;
}

void keep_give_back(void)
{
    pthread_mutex_lock(&K.run);
    own_table();
    for (uint32_t i = 0; i < K.n; i++)
        copy_free(K.v[i]);
    K.n = 0;
    K.look = true; /* pinned again once the application runs */
    pthread_mutex_unlock(&K.run);
}

void keep_request(bool keep)
{
    __atomic_store_n(&asked, keep ? 1 : 0, __ATOMIC_RELEASE);
    if (keep) {
        pthread_mutex_lock(&K.run);
        K.look = true; /* everything there is, at the next look */
        pthread_mutex_unlock(&K.run);
        keep_start();
        return;
    }
    keep_give_back();
}

void keep_forget_ctx(CUcontext ctx)
{
    pthread_mutex_lock(&K.run);
    if (K.pid == getpid()) {
        for (uint32_t i = 0; i < K.n; i++) {
            struct keep_copy *c = K.v[i];
            if (c->ctx != ctx || !c->host)
                continue;
            /* cuMemHostAlloc'd memory went with the context; a registered
             * mapping is ours and stays mapped. */
            account(c, -1);
            if (c->registered && munmap(c->host, c->len) != 0)
                shim_log(LOG_WARN, "munmap of a kept host copy failed: %s", strerror(errno));
            c->host = NULL;
            c->valid = false;
        }
        for (unsigned i = 0; i < KEEP_CTXS; i++)
            if (K.fns[i].ctx == ctx)
                memset(&K.fns[i], 0, sizeof K.fns[i]);
    }
    pthread_mutex_unlock(&K.run);
}

/* ------------------------------------------------------------ the hash */
static bool resolve_module_api(char *why, size_t n)
{
    if (!K.resolved) {
        K.load = (module_load_fn)shim_driver_symbol("cuModuleLoadData");
        K.get = (module_fn_fn)shim_driver_symbol("cuModuleGetFunction");
        K.unload = (module_unload_fn)shim_driver_symbol("cuModuleUnload");
        K.launch = (launch_fn)shim_driver_symbol("cuLaunchKernel");
        K.resolved = true;
    }
    if (!K.load || !K.get || !K.unload || !K.launch) {
        snprintf(why, n, "the driver lacks cuModuleLoadData, cuModuleGetFunction, "
                 "cuModuleUnload or cuLaunchKernel");
        return false;
    }
    return true;
}

/* The kernel of the current context `ctx`, loaded now if need be. */
static struct keep_fn *kernel_of(CUcontext ctx, char *why, size_t n)
{
    struct keep_fn *f = NULL;
    CUresult r;

    for (unsigned i = 0; i < KEEP_CTXS; i++)
        if (K.fns[i].mod && K.fns[i].ctx == ctx && K.fns[i].pid == getpid())
            return &K.fns[i];
    for (unsigned i = 0; i < KEEP_CTXS && !f; i++)
        if (!K.fns[i].mod || K.fns[i].pid != getpid())
            f = &K.fns[i];
    if (!f) {
        snprintf(why, n, "more than %d contexts hold kept allocations", KEEP_CTXS);
        return NULL;
    }
    memset(f, 0, sizeof *f);
    r = K.load(&f->mod, keep_hash_ptx);
    if (r != CUDA_SUCCESS) {
        snprintf(why, n, "cuModuleLoadData of the hash kernel (PTX ISA 8.0, JIT-compiled by the "
                 "driver) failed: %s", shim_cu_name(r));
        f->mod = NULL;
        return NULL;
    }
    r = K.get(&f->fn, f->mod, KH_ENTRY);
    if (r == CUDA_SUCCESS)
        r = real.cuStreamCreate(&f->stream, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS) {
        snprintf(why, n, "cuModuleGetFunction or cuStreamCreate for the hash kernel failed: %s",
                 shim_cu_name(r));
        /* Unloaded: the keeper and every SAVE try again, and would pile them up. */
        if ((r = K.unload(f->mod)) != CUDA_SUCCESS)
            shim_log(LOG_WARN, "cuModuleUnload of the hash kernel failed: %s", shim_cu_name(r));
        f->mod = NULL;
        return NULL;
    }
    f->ctx = ctx;
    f->pid = getpid();
    return f;
}

/* Hash the items of context `ctx` (current) into their `fresh` tables. */
static int hash_ctx(struct keep_item *items, uint32_t n, CUcontext ctx, char *why, size_t wn)
{
    struct keep_fn *f = kernel_of(ctx, why, wn);
    uint64_t total = 0, at = 0;
    unsigned long long *host;
    CUresult r;

    if (!f)
        return -1;
    for (uint32_t i = 0; i < n; i++)
        if (items[i].ctx == ctx)
            total += kh_chunks(items[i].c->size);
    if (total * 16 > f->out_len) {
        if (f->out && real.cuMemFree(f->out) != CUDA_SUCCESS)
            shim_log(LOG_WARN, "cuMemFree of the hash buffer failed");
        f->out = 0;
        f->out_len = 0;
        r = real.cuMemAlloc(&f->out, total * 16);
        if (r != CUDA_SUCCESS) {
            snprintf(why, wn, "cuMemAlloc of %llu bytes for the hashes failed: %s",
                     (unsigned long long)total * 16, shim_cu_name(r));
            f->out = 0;
            return -1;
        }
        f->out_len = total * 16;
    }
    host = malloc(total * 16);
    if (!host) {
        snprintf(why, wn, "out of memory for %llu hashes", (unsigned long long)total);
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        struct keep_item *it = &items[i];
        unsigned long long base = it->va, words = it->c->size / 8;
        unsigned long long out = f->out + at * 16;
        uint64_t chunks = kh_chunks(it->c->size);
        void *params[] = {&base, &words, &out};
        if (it->ctx != ctx)
            continue;
        r = K.launch(f->fn, (unsigned)chunks, 1, 1, KH_THREADS, 1, 1, 0, f->stream, params, NULL);
        if (r != CUDA_SUCCESS) {
            snprintf(why, wn, "cuLaunchKernel of the hash kernel failed: %s", shim_cu_name(r));
            goto fail;
        }
        at += chunks;
    }
    r = real.cuMemcpyDtoHAsync(host, f->out, total * 16, f->stream);
    if (r == CUDA_SUCCESS)
        r = real.cuStreamSynchronize(f->stream);
    if (r != CUDA_SUCCESS) {
        snprintf(why, wn, "the hash kernel's run or its copy back failed: %s", shim_cu_name(r));
        goto fail;
    }
    at = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t chunks;
        if (items[i].ctx != ctx)
            continue;
        chunks = kh_chunks(items[i].c->size);
        items[i].fresh = malloc(chunks * 16);
        if (!items[i].fresh) {
            snprintf(why, wn, "out of memory for %llu hashes", (unsigned long long)chunks);
            goto fail;
        }
        memcpy(items[i].fresh, host + 2 * at, chunks * 16);
        at += chunks;
    }
    free(host);
    return 0;
fail:
    /* Nothing may still write into `out` before it is used again: past a failed
     * wait the buffer is given up (the next SAVE makes another). */
    if ((r = real.cuStreamSynchronize(f->stream)) != CUDA_SUCCESS) {
        shim_log(LOG_WARN, "cuStreamSynchronize after a failed hash failed: %s; its buffer "
                 "is left to its context", shim_cu_name(r));
        f->out = 0;
        f->out_len = 0;
    }
    free(host);
    return -1;
}

int keep_hash(struct keep_item *items, uint32_t n, char *why, size_t wn)
{
    int rc = 0;

    for (uint32_t i = 0; i < n; i++)
        if (items[i].c->size % 8) {
            snprintf(why, wn, "an allocation of %llu bytes is not a whole number of 8-byte words",
                     (unsigned long long)items[i].c->size);
            return -1;
        }
    if (!resolve_module_api(why, wn))
        return -1;
    for (uint32_t i = 0; i < n && rc == 0; i++) {
        bool first = true, pushed;
        CUresult r;
        for (uint32_t j = 0; j < i; j++)
            if (items[j].ctx == items[i].ctx)
                first = false;
        if (!first)
            continue;
        r = shim_ctx_enter(items[i].ctx, &pushed);
        if (r != CUDA_SUCCESS) {
            snprintf(why, wn, "cuCtxPushCurrent failed: %s", shim_cu_name(r));
            rc = -1;
            break;
        }
        rc = hash_ctx(items, n, items[i].ctx, why, wn);
        shim_ctx_leave(pushed);
    }
    if (rc != 0)
        for (uint32_t i = 0; i < n; i++) {
            free(items[i].fresh);
            items[i].fresh = NULL;
        }
    return rc;
}

bool keep_chunk_same(const struct keep_copy *c, const uint64_t *fresh, uint64_t chunk)
{
    return c->valid && c->hash && fresh && !memcmp(c->hash + 2 * chunk, fresh + 2 * chunk, 16);
}

void keep_settle(struct keep_copy *c, uint64_t *fresh, bool ok)
{
    free(c->hash);
    c->hash = ok ? fresh : NULL;
    c->valid = ok && fresh;
    if (!ok)
        free(fresh);
}

int keep_record(struct reply *r, uint64_t copied, uint64_t unchanged, uint32_t hash)
{
    struct cuip_record *recs;
    uint64_t bytes, count, overhead;

    keep_status(&bytes, &count, &overhead);
    recs = realloc(r->records, (size_t)(r->h.count + 1) * sizeof *recs);
    if (!recs)
        return -1;
    r->records = recs;
    memset(&recs[r->h.count], 0, sizeof *recs);
    cuip_set_host_copy(&recs[r->h.count], bytes, count, overhead, copied, unchanged, hash);
    r->h.count++;
    return 0;
}
