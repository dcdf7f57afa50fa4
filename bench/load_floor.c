/*
 * LOAD's floor on this driver, without the shim (bench/load_floor.py runs it
 * and says what the figures mean): a shape's allocations re-created on one
 * thread while copy threads copy each one in from pinned memory as soon as
 * it is made, against each half alone. In C because in Python the copy
 * threads' interpreter work between driver calls took the GIL from the
 * thread that re-creates: 2048 x 2 MiB took 0.30 s both at once against
 * 0.14 s and 0.17 s alone, slower than the shim itself.
 *
 *   load_floor LIBCUDA COUNT MIB THREADS PIECE_MIB REPEAT CEILING_MIB [SOURCE]
 *
 * SOURCE is where the bytes come from: "pinned" (the default: each copy
 * thread's pinned buffer, DMA alone: the driver's floor) or "staged" (one
 * populated anonymous mapping of every allocation's bytes, 2 MiB pages where
 * THP allows, as SAVE leaves them, cut in units of the shim's LOAD chunk;
 * each copy thread memcpy's a piece into one half of its pinned buffer of two
 * pieces while the copy engine drains the other, and waits on blocking-sync
 * events: the shim's bounce design with nothing of the shim's around it, so
 * the driver's and the host's floor together; and the memcpy alone, the
 * host's part, as "memcpy_s"), drained after every unit as the shim drains
 * after every chunk, or "piped" (the same, each thread's pipeline running on
 * across its units: the best this design allows).
 *
 * One JSON object on stdout: every run's seconds per case, and the pinned
 * HtoD ceiling of one buffer. Every result checked; on an error the message
 * names the call and its result, and the exit status is 1.
 */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define MIB ((size_t)1 << 20)
#define MAX_THREADS 64
#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*AddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*AddressFree)(CUdeviceptr, size_t);
    CUresult (*Create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                       unsigned long long);
    CUresult (*Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                    unsigned long long);
    CUresult (*SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*Unmap)(CUdeviceptr, size_t);
    CUresult (*Release)(CUmemGenericAllocationHandle);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*HostAlloc)(void **, size_t, unsigned);
    CUresult (*FreeHost)(void *);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*EventCreate)(CUevent *, unsigned);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;

static CUcontext ctx;
static CUmemAllocationProp prop;
static CUmemAccessDesc access_desc;

/* The first error wins; the others only end their thread's work. */
static pthread_mutex_t fail_lock = PTHREAD_MUTEX_INITIALIZER;
static char fail_msg[256];
static int failed; /* atomic */

static bool has_failed(void)
{
    return __atomic_load_n(&failed, __ATOMIC_ACQUIRE) != 0;
}

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...)
{
    va_list ap;

    pthread_mutex_lock(&fail_lock);
    if (!has_failed()) {
        va_start(ap, fmt);
        vsnprintf(fail_msg, sizeof fail_msg, fmt, ap);
        va_end(ap);
        __atomic_store_n(&failed, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&fail_lock);
    return -1;
}

static int check(const char *call, CUresult r)
{
    const char *name = NULL;

    if (r == CUDA_SUCCESS)
        return 0;
    if (!cu.GetErrorName || cu.GetErrorName(r, &name) != CUDA_SUCCESS || !name)
        name = "?";
    return fail("%s failed: %s (%d)", call, name, (int)r);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int resolve(const char *path)
{
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    struct {
        void **slot;
        const char *name;
    } table[] = {
        {(void **)&cu.Init, "cuInit"},
        {(void **)&cu.DeviceGet, "cuDeviceGet"},
        {(void **)&cu.PrimaryCtxRetain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cu.CtxSetCurrent, "cuCtxSetCurrent"},
        {(void **)&cu.AddressReserve, "cuMemAddressReserve"},
        {(void **)&cu.AddressFree, "cuMemAddressFree"},
        {(void **)&cu.Create, "cuMemCreate"},
        {(void **)&cu.Map, "cuMemMap"},
        {(void **)&cu.SetAccess, "cuMemSetAccess"},
        {(void **)&cu.Unmap, "cuMemUnmap"},
        {(void **)&cu.Release, "cuMemRelease"},
        {(void **)&cu.StreamCreate, "cuStreamCreate"},
        {(void **)&cu.StreamDestroy, "cuStreamDestroy_v2"},
        {(void **)&cu.StreamSynchronize, "cuStreamSynchronize"},
        {(void **)&cu.HostAlloc, "cuMemHostAlloc"},
        {(void **)&cu.FreeHost, "cuMemFreeHost"},
        {(void **)&cu.MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"},
        {(void **)&cu.MemcpyDtoH, "cuMemcpyDtoH_v2"},
        {(void **)&cu.EventCreate, "cuEventCreate"},
        {(void **)&cu.EventRecord, "cuEventRecord"},
        {(void **)&cu.EventSynchronize, "cuEventSynchronize"},
        {(void **)&cu.EventDestroy, "cuEventDestroy_v2"},
        {(void **)&cu.MemAlloc, "cuMemAlloc_v2"},
        {(void **)&cu.MemFree, "cuMemFree_v2"},
        {(void **)&cu.GetErrorName, "cuGetErrorName"},
    };

    if (!lib)
        return fail("dlopen %s: %s", path, dlerror());
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        *table[i].slot = dlsym(lib, table[i].name);
        if (!*table[i].slot)
            return fail("%s lacks %s", path, table[i].name);
    }
    return 0;
}

static int open_device(void)
{
    CUdevice dev;

    if (check("cuInit", cu.Init(0)) || check("cuDeviceGet", cu.DeviceGet(&dev, 0)) ||
        check("cuDevicePrimaryCtxRetain", cu.PrimaryCtxRetain(&ctx, dev)) ||
        check("cuCtxSetCurrent", cu.CtxSetCurrent(ctx)))
        return -1;
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    access_desc.location = prop.location;
    access_desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return 0;
}

/* ------------------------------------------------------------ one run */
struct run {
    size_t count, size, piece;
    char *staged;               /* SOURCE staged: allocation k's bytes at k * size */
    /* Staged: the work is cut in units of at most `unit` bytes, `per` to an
     * allocation, so that one large allocation spreads over every thread as
     * the shim's chunks do; pinned: one unit per allocation. */
    size_t unit, per;
    bool dma;                   /* false: the memcpy alone, no copy to the device */
    /* Staged: each thread's pipeline runs on across its units (its first
     * piece of a unit memcpy'd while its last of the unit before copies),
     * drained once when the thread ends; else drained after every unit, as
     * the shim drains after every chunk. */
    bool piped;
    CUdeviceptr *vas;
    CUmemGenericAllocationHandle *handles;
    /* Allocations made so far, and the next unit to copy (under lock). */
    pthread_mutex_t lock;
    pthread_cond_t more;
    size_t made, next;
};

/* Thread-side: one copy thread's stream and pinned buffer (staged: two
 * pieces, each with the event recorded after its copy). */
struct copier {
    struct run *r;
    CUstream stream;
    void *buf;
    CUevent done[2];
    size_t issued;              /* piped: pieces queued so far, across units */
    pthread_t tid;
};

static int make_one(struct run *r, size_t k)
{
    CUmemGenericAllocationHandle h;

    if (check("cuMemCreate", cu.Create(&h, r->size, &prop, 0)))
        return -1;
    if (check("cuMemMap", cu.Map(r->vas[k], r->size, 0, h, 0)))
        goto fail_h;
    if (check("cuMemSetAccess", cu.SetAccess(r->vas[k], r->size, &access_desc, 1)))
        goto fail_map;
    r->handles[k] = h;
    return 0;
fail_map:
    cu.Unmap(r->vas[k], r->size);
fail_h:
    cu.Release(h);
    return -1;
}

static int unmake(struct run *r, size_t made)
{
    int rc = 0;

    for (size_t k = 0; k < made; k++)
        if (check("cuMemUnmap", cu.Unmap(r->vas[k], r->size)) ||
            check("cuMemRelease", cu.Release(r->handles[k])))
            rc = -1;
    return rc;
}

/* Wait for the copies of the last two pieces of `issued` (no more are in
 * flight: each half is waited for before it is filled again). */
static int drain(struct copier *c, size_t issued)
{
    for (size_t i = issued > 2 ? issued - 2 : 0; c->r->dma && i < issued; i++)
        if (check("cuEventSynchronize", cu.EventSynchronize(c->done[i % 2])))
            return -1;
    return 0;
}

/* Staged: unit u's piece j through half j % 2 of the buffer, memcpy'd in once
 * the copy of piece j - 2 (the same half) is done; both halves drained at the
 * end. Without dma, the memcpy alone. */
static int copy_staged(struct copier *c, size_t u)
{
    struct run *r = c->r;
    size_t k = u / r->per, at = u % r->per * r->unit;
    size_t end = at + r->unit < r->size ? at + r->unit : r->size;
    const char *src = r->staged + k * r->size;
    size_t j = r->piped ? c->issued : 0;

    for (size_t off = at; off < end; off += r->piece, j++) {
        size_t n = end - off < r->piece ? end - off : r->piece;
        char *half = (char *)c->buf + (j % 2) * r->piece;
        if (r->dma && j >= 2 && check("cuEventSynchronize", cu.EventSynchronize(c->done[j % 2])))
            goto fail;
        memcpy(half, src + off, n);
        if (!r->dma)
            continue;
        if (check("cuMemcpyHtoDAsync", cu.MemcpyHtoDAsync(r->vas[k] + off, half, n, c->stream)) ||
            check("cuEventRecord", cu.EventRecord(c->done[j % 2], c->stream)))
            goto fail;
    }
    if (r->piped) {
        c->issued = j;
        return 0;
    }
    return drain(c, j);
fail:
    /* Nothing may still read the buffer once the thread ends. */
    cu.StreamSynchronize(c->stream);
    c->issued = 0;
    return -1;
}

static int copy_one(struct copier *c, size_t k)
{
    struct run *r = c->r;

    if (r->staged)
        return copy_staged(c, k);
    for (size_t off = 0; off < r->size; off += r->piece) {
        size_t n = r->size - off < r->piece ? r->size - off : r->piece;
        if (check("cuMemcpyHtoDAsync", cu.MemcpyHtoDAsync(r->vas[k] + off, c->buf, n, c->stream)))
            return -1;
    }
    return check("cuStreamSynchronize", cu.StreamSynchronize(c->stream));
}

/* Copy units in order, each once its allocation is made, until all are
 * copied. */
static void *copy_main(void *arg)
{
    struct copier *c = arg;
    struct run *r = c->r;
    size_t units = r->count * r->per;

    c->issued = 0;
    if (check("cuCtxSetCurrent", cu.CtxSetCurrent(ctx)))
        return NULL;
    for (;;) {
        size_t k;

        pthread_mutex_lock(&r->lock);
        while (r->next < units && r->next / r->per >= r->made && !has_failed())
            pthread_cond_wait(&r->more, &r->lock);
        if (r->next == units || has_failed()) {
            pthread_mutex_unlock(&r->lock);
            if (r->piped)
                drain(c, c->issued); /* after a failure too: nothing left in flight */
            return NULL;
        }
        k = r->next++;
        pthread_mutex_unlock(&r->lock);
        if (copy_one(c, k) != 0) {
            pthread_mutex_lock(&r->lock);
            pthread_cond_broadcast(&r->more);
            pthread_mutex_unlock(&r->lock);
            return NULL;
        }
    }
}

static void publish(struct run *r, size_t made)
{
    pthread_mutex_lock(&r->lock);
    r->made = made;
    pthread_cond_broadcast(&r->more);
    pthread_mutex_unlock(&r->lock);
}

/* The copy threads over what is (or becomes) made; the wall time from their
 * start to the last copy's end, re-creating on this thread when `create`. */
static double copy_phase(struct run *r, struct copier *cs, unsigned threads, bool create)
{
    double t0;
    unsigned started = 0;
    size_t made = create ? 0 : r->count;

    r->made = made;
    r->next = 0;
    t0 = now();
    for (; started < threads; started++)
        if (pthread_create(&cs[started].tid, NULL, copy_main, &cs[started]) != 0) {
            fail("pthread_create failed");
            break;
        }
    while (create && made < r->count && !has_failed()) {
        if (make_one(r, made) != 0)
            break;
        publish(r, ++made);
    }
    if (has_failed())
        publish(r, made); /* wakes the waiting copy threads: they see `failed` */
    for (unsigned i = 0; i < started; i++)
        pthread_join(cs[i].tid, NULL);
    if (create)
        r->made = made; /* what unmake undoes */
    return now() - t0;
}

static double recreate(struct run *r)
{
    double t0 = now();

    for (r->made = 0; r->made < r->count; r->made++)
        if (make_one(r, r->made) != 0)
            break;
    return now() - t0;
}

static double ceiling(size_t size)
{
    CUdeviceptr dev = 0;
    CUstream s = NULL;
    void *buf = NULL;
    double best = -1;

    if (check("cuMemAlloc", cu.MemAlloc(&dev, size)) ||
        check("cuMemHostAlloc", cu.HostAlloc(&buf, size, 0)) ||
        check("cuStreamCreate", cu.StreamCreate(&s, CU_STREAM_NON_BLOCKING)))
        goto done;
    for (int i = 0; i < 3; i++) {
        double t0 = now(), gbps;
        if (check("cuMemcpyHtoDAsync", cu.MemcpyHtoDAsync(dev, buf, size, s)) ||
            check("cuStreamSynchronize", cu.StreamSynchronize(s)))
            goto done;
        gbps = (double)size / (now() - t0) / 1e9;
        if (gbps > best)
            best = gbps;
    }
done:
    if (s)
        check("cuStreamDestroy", cu.StreamDestroy(s));
    if (buf)
        check("cuMemFreeHost", cu.FreeHost(buf));
    if (dev)
        check("cuMemFree", cu.MemFree(dev));
    return best;
}

static void print_runs(const char *name, const double *v, unsigned n, bool last)
{
    printf("\"%s\": [", name);
    for (unsigned i = 0; i < n; i++)
        printf("%s%.6f", i ? ", " : "", v[i]);
    printf("]%s", last ? "" : ", ");
}

/* Staged: the first byte of every MiB of every allocation is its source's
 * (each MiB of the source has a value of its own), so a piece copied from the
 * wrong place or not at all is seen. */
static int verify(struct run *r)
{
    for (size_t k = 0; k < r->count; k++)
        for (size_t off = 0; off < r->size; off += MIB) {
            unsigned char got;
            if (check("cuMemcpyDtoH", cu.MemcpyDtoH(&got, r->vas[k] + off, 1)))
                return -1;
            if (got != (unsigned char)r->staged[k * r->size + off])
                return fail("allocation %zu at %zu holds 0x%02x, its source 0x%02x", k, off,
                            got, (unsigned char)r->staged[k * r->size + off]);
        }
    return 0;
}

/* Staged: the shim's LOAD chunk for `threads` (staging.c, pick_chunk: about
 * four per thread, whole MiB, 1 to 64 MiB), at most an allocation. */
static void cut_units(struct run *r, unsigned threads)
{
    size_t even = r->count * r->size / ((size_t)threads * 4) / MIB * MIB;

    r->unit = r->size;
    if (r->staged) {
        even = even < MIB ? MIB : even > 64 * MIB ? 64 * MIB : even;
        r->unit = even < r->size ? even : r->size;
    }
    r->per = (r->size + r->unit - 1) / r->unit;
}

static int measure(struct run *r, unsigned threads, unsigned repeat, size_t ceiling_bytes)
{
    struct copier cs[MAX_THREADS];
    double *recreate_s = calloc(repeat, sizeof(double));
    double *copy_s = calloc(repeat, sizeof(double));
    double *memcpy_s = calloc(repeat, sizeof(double));
    double *overlap_s = calloc(repeat, sizeof(double));
    double htod;
    int rc = -1;

    memset(cs, 0, sizeof cs);
    cut_units(r, threads);
    r->dma = true;
    if (!recreate_s || !copy_s || !memcpy_s || !overlap_s) {
        fail("out of memory for %u runs", repeat);
        goto done;
    }
    for (unsigned i = 0; i < threads; i++) {
        cs[i].r = r;
        if (check("cuStreamCreate", cu.StreamCreate(&cs[i].stream, CU_STREAM_NON_BLOCKING)) ||
            check("cuMemHostAlloc",
                  cu.HostAlloc(&cs[i].buf, r->staged ? 2 * r->piece : r->piece, 0)))
            goto done;
        /* Blocking sync, as the shim waits: a waiting thread gives its CPU to
         * the ones that memcpy. */
        for (unsigned e = 0; r->staged && e < 2; e++)
            if (check("cuEventCreate",
                      cu.EventCreate(&cs[i].done[e],
                                     CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING)))
                goto done;
    }
    for (unsigned i = 0; i < repeat && !has_failed(); i++) {
        recreate_s[i] = recreate(r);
        if (!has_failed())
            copy_s[i] = copy_phase(r, cs, threads, false);
        if (r->staged && !has_failed()) { /* the host's part alone */
            r->dma = false;
            memcpy_s[i] = copy_phase(r, cs, threads, false);
            r->dma = true;
        }
        if (unmake(r, r->made) != 0 || has_failed())
            break;
        overlap_s[i] = copy_phase(r, cs, threads, true);
        if (r->staged && !has_failed() && r->made == r->count)
            verify(r);
        if (unmake(r, r->made) != 0)
            break;
    }
    htod = has_failed() ? -1 : ceiling(ceiling_bytes);
    if (has_failed())
        goto done;
    printf("{\"source\": \"%s\", ", r->piped ? "piped" : r->staged ? "staged" : "pinned");
    print_runs("recreate_s", recreate_s, repeat, false);
    print_runs("copy_s", copy_s, repeat, false);
    if (r->staged)
        print_runs("memcpy_s", memcpy_s, repeat, false);
    print_runs("overlap_s", overlap_s, repeat, false);
    printf("\"unit\": %zu, \"htod_ceiling_gbps\": %.3f}\n", r->unit, htod);
    rc = 0;
done:
    for (unsigned i = 0; i < threads; i++) { /* zeroed: what was made is non-null */
        if (cs[i].stream)
            check("cuStreamDestroy", cu.StreamDestroy(cs[i].stream));
        if (cs[i].buf)
            check("cuMemFreeHost", cu.FreeHost(cs[i].buf));
        for (unsigned e = 0; e < 2; e++)
            if (cs[i].done[e])
                check("cuEventDestroy", cu.EventDestroy(cs[i].done[e]));
    }
    free(recreate_s);
    free(copy_s);
    free(memcpy_s);
    free(overlap_s);
    return rc;
}

static int number(const char *text, unsigned long long max, unsigned long long *out)
{
    char *end;
    unsigned long long v = strtoull(text, &end, 10);

    if (!*text || *end || v < 1 || v > max)
        return fail("'%s' is not a number in [1, %llu]", text, max);
    *out = v;
    return 0;
}

/* SOURCE staged: every allocation's bytes in one anonymous mapping, written
 * (populated) before any run, as SAVE leaves them. */
static char *stage(size_t len)
{
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

    if (p == MAP_FAILED) {
        fail("mmap of %zu bytes of staged memory failed", len);
        return NULL;
    }
    madvise(p, len, MADV_HUGEPAGE); /* small pages where THP is off: still a source */
    for (size_t off = 0; off < len; off += MIB)
        memset(p + off, (int)((off / MIB * 7 + 1) & 0xff), len - off < MIB ? len - off : MIB);
    return p;
}

int main(int argc, char **argv)
{
    unsigned long long count, mib, threads, piece_mib, repeat, ceiling_mib;
    bool staged = false;
    struct run r;
    int rc = 1;

    memset(&r, 0, sizeof r);
    if (argc != 8 && argc != 9) {
        fprintf(stderr,
                "usage: %s LIBCUDA COUNT MIB THREADS PIECE_MIB REPEAT CEILING_MIB "
                "[pinned|staged|piped]\n",
                argv[0]);
        return 2;
    }
    if (number(argv[2], 1u << 20, &count) || number(argv[3], 1u << 16, &mib) ||
        number(argv[4], MAX_THREADS, &threads) || number(argv[5], 1024, &piece_mib) ||
        number(argv[6], 100, &repeat) || number(argv[7], 1u << 16, &ceiling_mib)) {
        fprintf(stderr, "load_floor: %s\n", fail_msg);
        return 2;
    }
    if (argc == 9) {
        if (strcmp(argv[8], "staged") != 0 && strcmp(argv[8], "piped") != 0 &&
            strcmp(argv[8], "pinned") != 0) {
            fprintf(stderr, "load_floor: source '%s' is not pinned, staged or piped\n",
                    argv[8]);
            return 2;
        }
        staged = strcmp(argv[8], "pinned") != 0;
        r.piped = strcmp(argv[8], "piped") == 0;
    }
    r.count = count;
    r.size = mib * MIB;
    r.piece = piece_mib * MIB < r.size ? piece_mib * MIB : r.size;
    if (staged && !(r.staged = stage(count * r.size)))
        goto done;
    r.vas = calloc(count, sizeof *r.vas);
    r.handles = calloc(count, sizeof *r.handles);
    pthread_mutex_init(&r.lock, NULL);
    pthread_cond_init(&r.more, NULL);
    if (!r.vas || !r.handles) {
        fail("out of memory for %llu allocations", count);
        goto done;
    }
    if (resolve(argv[1]) || open_device())
        goto done;
    for (size_t k = 0; k < count; k++)
        if (check("cuMemAddressReserve", cu.AddressReserve(&r.vas[k], r.size, 0, 0, 0)))
            goto free_vas;
    /* The driver's first VMM calls of a process are slower: one warm-up. */
    r.count = count < 64 ? count : 64;
    recreate(&r);
    if (unmake(&r, r.made) == 0 && !has_failed()) {
        r.count = count;
        rc = measure(&r, (unsigned)threads, (unsigned)repeat, ceiling_mib * MIB) ? 1 : 0;
    }
free_vas:
    for (size_t k = 0; k < count && r.vas[k]; k++)
        check("cuMemAddressFree", cu.AddressFree(r.vas[k], r.size));
done:
    if (has_failed()) {
        fprintf(stderr, "load_floor: %s\n", fail_msg);
        rc = 1;
    }
    free(r.vas);
    free(r.handles);
    if (r.staged)
        munmap(r.staged, count * r.size);
    return rc;
}
