/* Devices, contexts, streams, events and cuMemGetInfo.
 *
 * Devices are identical simulated H200-like GPUs that say what they are in
 * their name. Each stream (and each context's NULL stream) has a queue and
 * a worker thread that runs its work in order after the launching call
 * returned: async copies, async memsets and host functions are in flight
 * until a synchronize (or a query) says they are done, as on the GPU.
 * Work that finds its memory gone when it runs fails the context for good
 * (the GPU's illegal address). Events complete in stream order; an
 * interprocess event's records complete in whichever process queued them. */
#include "sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* The calling thread's context stack (cuCtxPush/Pop, cuCtxSetCurrent):
 * per-thread by definition, so it cannot live in struct sim_state. */
static _Thread_local struct {
    struct sim_ctx *stack[SIM_CTX_STACK];
    int depth;
} tls;

int sim_dev_valid(CUdevice dev)
{
    return dev >= 0 && dev < sim.ndev;
}

static struct sim_ctx *current(void)
{
    return tls.depth > 0 ? tls.stack[tls.depth - 1] : NULL;
}

/* A context handle is the address of one of our table entries; anything
 * else is rejected without being dereferenced. */
struct sim_ctx *sim_ctx_check(CUcontext c)
{
    struct sim_ctx *p = (struct sim_ctx *)c;

    if (p >= &sim.primary[0] && p < &sim.primary[SIM_MAX_DEVICES] && p->used)
        return p;
    if (p >= &sim.ctxs[0] && p < &sim.ctxs[SIM_MAX_CTXS] && p->used)
        return p;
    return NULL;
}

struct sim_ctx *sim_current_ctx(void)
{
    struct sim_ctx *c = current();

    return c && c->used ? c : NULL;
}

/* A context's index in the peer tables: primaries first, then created. */
int sim_ctx_slot(const struct sim_ctx *c)
{
    if (c >= &sim.primary[0] && c < &sim.primary[SIM_MAX_DEVICES])
        return (int)(c - sim.primary);
    return SIM_MAX_DEVICES + (int)(c - sim.ctxs);
}

/* sim.mu held: may device `dev` access the cuMemAlloc memory of `owner`?
 * Its own device may; another one once a context of it enabled peer
 * access to `owner` (peer.c). */
int sim_dev_sees_ctx(int dev, const struct sim_ctx *owner)
{
    int slot = sim_ctx_slot(owner);

    if (dev == owner->dev)
        return 1;
    for (int i = 0; i < SIM_MAX_DEVICES; i++)
        if (sim.primary[i].used && sim.primary[i].dev == dev && sim.primary[i].peer[slot])
            return 1;
    for (int i = 0; i < SIM_MAX_CTXS; i++)
        if (sim.ctxs[i].used && sim.ctxs[i].dev == dev && sim.ctxs[i].peer[slot])
            return 1;
    return 0;
}

CUresult sim_current_dev(int *dev)
{
    struct sim_ctx *c = current();

    if (!c || !c->used)
        return CUDA_ERROR_INVALID_CONTEXT;
    *dev = c->dev;
    return CUDA_SUCCESS;
}

static int stream_valid(CUstream s)
{
    struct sim_stream *p = (struct sim_stream *)s;

    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD)
        return 1;
    return p >= &sim.streams[0] && p < &sim.streams[SIM_MAX_STREAMS] && p->used;
}

CUresult sim_stream_check(CUstream s)
{
    int ok;

    sim_lock();
    ok = stream_valid(s);
    sim_unlock();
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* ---- stream queues ---------------------------------------------------- */

static void *queue_worker(void *arg)
{
    struct sim_queue *q = arg;

    pthread_mutex_lock(&q->mu);
    for (;;) {
        struct sim_work *w;
        CUresult r;

        while (!q->head)
            pthread_cond_wait(&q->cv, &q->mu);
        w = q->head;
        pthread_mutex_unlock(&q->mu);
        if (sim.work_us > 0) {
            struct timespec ts = {sim.work_us / 1000000, (sim.work_us % 1000000) * 1000};
            nanosleep(&ts, NULL);
        }
        r = w->run(w);
        if (r != CUDA_SUCCESS) {
            int none = CUDA_SUCCESS;
            atomic_compare_exchange_strong(&w->ctx->sticky, &none, (int)r);
        }
        pthread_mutex_lock(&q->mu);
        q->head = w->next;
        if (!q->head)
            q->tail = NULL;
        q->pending--;
        pthread_cond_broadcast(&q->cv);
        free(w);
    }
    return NULL;
}

/* sim.mu held: the worker starts with the queue's first work. */
static CUresult queue_start(struct sim_queue *q)
{
    pthread_t t;
    pthread_attr_t at;
    int rc;

    if (q->started)
        return CUDA_SUCCESS;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->head = q->tail = NULL;
    q->pending = 0;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&t, &at, queue_worker, q);
    pthread_attr_destroy(&at);
    if (rc != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    q->started = 1;
    return CUDA_SUCCESS;
}

static int special_stream(CUstream s)
{
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}

CUresult sim_enqueue(CUstream s, const struct sim_work *work)
{
    struct sim_ctx *c = current();
    struct sim_queue *q;
    struct sim_work *w;
    CUresult r;

    if (!c || !c->used)
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_lock();
    if (!stream_valid(s)) {
        sim_unlock();
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (special_stream(s)) {
        q = &c->queue;
    } else {
        q = &((struct sim_stream *)s)->queue;
        c = ((struct sim_stream *)s)->ctx;
    }
    r = atomic_load(&c->sticky);
    if (r == CUDA_SUCCESS)
        r = queue_start(q);
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    w = malloc(sizeof *w);
    if (!w)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *w = *work;
    w->ctx = c;
    w->dev = c->dev;
    w->next = NULL;
    pthread_mutex_lock(&q->mu);
    if (q->tail)
        q->tail->next = w;
    else
        q->head = w;
    q->tail = w;
    q->pending++;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return CUDA_SUCCESS;
}

/* Without sim.mu: a started queue's mu and cv stay valid for the process. */
static void queue_wait(struct sim_queue *q)
{
    if (!__atomic_load_n(&q->started, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&q->mu);
    while (q->pending)
        pthread_cond_wait(&q->cv, &q->mu);
    pthread_mutex_unlock(&q->mu);
}

static int queue_busy(struct sim_queue *q)
{
    int busy;

    if (!__atomic_load_n(&q->started, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&q->mu);
    busy = q->pending != 0;
    pthread_mutex_unlock(&q->mu);
    return busy;
}

/* Every queue of context `c`: its NULL stream's, then each stream's
 * (only the blocking ones when `blocking_only`, as the legacy stream). */
static CUresult ctx_wait(struct sim_ctx *c, int blocking_only)
{
    queue_wait(&c->queue);
    for (int i = 0; i < SIM_MAX_STREAMS; i++) {
        struct sim_stream *st = &sim.streams[i];
        int mine;

        sim_lock();
        mine = st->used && st->ctx == c &&
               !(blocking_only && (st->flags & CU_STREAM_NON_BLOCKING));
        sim_unlock();
        if (mine)
            queue_wait(&st->queue);
    }
    return (CUresult)atomic_load(&c->sticky);
}

CUresult sim_legacy_wait(void)
{
    struct sim_ctx *c = current();

    if (!c || !c->used)
        return CUDA_ERROR_INVALID_CONTEXT;
    return ctx_wait(c, 1);
}

/* ---- devices ---------------------------------------------------------- */

static CUresult device_get(CUdevice *device, int ordinal)
{
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal)
{
    SIM_API(device_get(device, ordinal));
}

static CUresult device_count(int *count)
{
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = sim.ndev;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int *count)
{
    SIM_API(device_count(count));
}

static CUresult device_name(char *name, int len, CUdevice dev)
{
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", sim.chip);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev)
{
    SIM_API(device_name(name, len, dev));
}

/* Recognisable ("cuipsim"), the node's, and the GPU the ordinal names now
 * (a restore with gpuPairs changes it: checkpoint.c). */
static CUresult device_uuid(CUuuid *uuid, CUdevice dev)
{
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    sim_gpu_uuid(sim.node, sim.gpu[dev], uuid->bytes);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    SIM_API(device_uuid(uuid, dev));
}

static CUresult device_attr(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if ((int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = 32; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 132; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *pi = 0x18 + dev; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *pi = 1; break; /* ordered.c */
    case CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *pi = 49152; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: *pi = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *pi = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *pi = 5120; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: *pi = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: *pi = (int)SIM_MAX_PITCH; break;
    case CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED: *pi = 1; break; /* ipc.c */
    default: *pi = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    SIM_API(device_attr(pi, attrib, dev));
}

static CUresult device_total_mem(size_t *bytes, CUdevice dev)
{
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = sim.mem_total;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    SIM_API(device_total_mem(bytes, dev));
}

static CUresult device_cc(int *major, int *minor, CUdevice dev)
{
    if (!major || !minor)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *major = 9;
    *minor = 0;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    SIM_API(device_cc(major, minor, dev));
}

static CUresult device_pci(char *busid, int len, CUdevice dev)
{
    if (!busid || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(busid, (size_t)len, "0000:%02x:00.0", 0x18 + dev);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    SIM_API(device_pci(pciBusId, len, dev));
}

static CUresult can_access_peer(int *can, CUdevice dev, CUdevice peer)
{
    if (!can)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev) || !sim_dev_valid(peer))
        return CUDA_ERROR_INVALID_DEVICE;
    *can = dev != peer; /* NVLink-connected peers, like an HGX board */
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    SIM_API(can_access_peer(canAccessPeer, dev, peerDev));
}

/* ---- primary contexts ------------------------------------------------- */

/* `c` is destroyed: as the driver does, its pinned host memory goes with it
 * (cuMemHostAlloc'd: unmapped, so that a later touch faults; registered:
 * unregistered), and so do its streams, once their queued work has run (as
 * stream_destroy waits). */
static void drop_ctx(const struct sim_ctx *c)
{
    for (int i = 0; i < SIM_MAX_HOST; i++) {
        void *addr = NULL;
        size_t size = 0;

        sim_lock();
        if (sim.host[i].used && sim.host[i].ctx == c) {
            if (!sim.host[i].registered) {
                addr = sim.host[i].p;
                size = sim.host[i].size;
            }
            memset(&sim.host[i], 0, sizeof sim.host[i]);
        }
        sim_unlock();
        if (addr)
            munmap(addr, size);
    }
    for (int i = 0; i < SIM_MAX_STREAMS; i++) {
        struct sim_stream *st = &sim.streams[i];
        int mine;

        sim_lock();
        mine = st->used && st->ctx == c;
        sim_unlock();
        if (!mine)
            continue;
        queue_wait(&st->queue);
        sim_lock();
        st->used = 0;
        sim_unlock();
    }
}

static CUresult primary_retain(CUcontext *pctx, CUdevice dev)
{
    struct sim_ctx *c;

    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    sim_lock();
    c = &sim.primary[dev];
    if (!c->used) {
        c->used = 1;
        c->primary = 1;
        c->dev = dev;
        c->id = sim.next_ctx_id++;
    }
    c->refs++;
    sim_unlock();
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    SIM_API(primary_retain(pctx, dev));
}

static CUresult primary_release(CUdevice dev)
{
    CUresult r = CUDA_SUCCESS;
    int last = 0;

    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    sim_lock();
    /* The context object stays valid (the handle is stable per device);
     * only its retain count drops, as on the real driver, and the last
     * release takes its resources. */
    if (sim.primary[dev].refs <= 0)
        r = CUDA_ERROR_INVALID_CONTEXT;
    else
        last = --sim.primary[dev].refs == 0;
    sim_unlock();
    if (last)
        drop_ctx(&sim.primary[dev]);
    return r;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    SIM_API(primary_release(dev));
}

static CUresult primary_state(CUdevice dev, unsigned int *flags, int *active)
{
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    sim_lock();
    *flags = sim.primary[dev].flags;
    *active = sim.primary[dev].refs > 0;
    sim_unlock();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    SIM_API(primary_state(dev, flags, active));
}

static CUresult primary_set_flags(CUdevice dev, unsigned int flags)
{
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    sim_lock();
    sim.primary[dev].flags = flags;
    sim_unlock();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    SIM_API(primary_set_flags(dev, flags));
}

static CUresult primary_reset(CUdevice dev)
{
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    drop_ctx(&sim.primary[dev]);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    SIM_API(primary_reset(dev));
}

/* ---- contexts --------------------------------------------------------- */

static CUresult ctx_push(struct sim_ctx *c)
{
    if (tls.depth >= SIM_CTX_STACK)
        return CUDA_ERROR_OUT_OF_MEMORY;
    tls.stack[tls.depth++] = c;
    return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    struct sim_ctx *c = NULL;
    CUresult r;

    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_dev_valid(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    sim_lock();
    for (int i = 0; i < SIM_MAX_CTXS && !c; i++)
        if (!sim.ctxs[i].used)
            c = &sim.ctxs[i];
    if (c) {
        memset(c, 0, sizeof(*c));
        c->used = 1;
        c->dev = dev;
        c->flags = flags;
        c->refs = 1;
        c->id = sim.next_ctx_id++;
    }
    sim_unlock();
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r = ctx_push(c);
    if (r != CUDA_SUCCESS) {
        sim_lock();
        c->used = 0;
        sim_unlock();
        return r;
    }
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    SIM_API(ctx_create(pctx, flags, dev));
}

CUresult CUDAAPI cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                                CUdevice dev)
{
    /* Execution affinity and CIG need MPS or graphics interop. */
    if (params && (params->execAffinityParams || params->cigParams))
        return CUDA_ERROR_NOT_SUPPORTED;
    SIM_API(ctx_create(pctx, flags, dev));
}

static CUresult ctx_destroy(CUcontext ctx)
{
    struct sim_ctx *c;

    sim_lock();
    c = sim_ctx_check(ctx);
    if (c && !c->primary) {
        int slot = sim_ctx_slot(c);

        c->used = 0;
        /* Peer access to a context ends with it. */
        for (int i = 0; i < SIM_MAX_DEVICES; i++)
            sim.primary[i].peer[slot] = 0;
        for (int i = 0; i < SIM_MAX_CTXS; i++)
            sim.ctxs[i].peer[slot] = 0;
    }
    sim_unlock();
    if (!c || c->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    drop_ctx(c);
    /* Only this thread's stack can be cleaned; other threads find the
     * context invalid on their next use. */
    for (int i = 0; i < tls.depth; i++)
        if (tls.stack[i] == c)
            tls.stack[i] = NULL;
    while (tls.depth > 0 && tls.stack[tls.depth - 1] == NULL)
        tls.depth--;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxDestroy_v2(CUcontext ctx)
{
    SIM_API(ctx_destroy(ctx));
}

static CUresult ctx_set_current(CUcontext ctx)
{
    struct sim_ctx *c = NULL;

    if (ctx) {
        sim_lock();
        c = sim_ctx_check(ctx);
        sim_unlock();
        if (!c)
            return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (!c) {
        if (tls.depth > 0)
            tls.depth--;
        return CUDA_SUCCESS;
    }
    if (tls.depth == 0)
        return ctx_push(c);
    tls.stack[tls.depth - 1] = c;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx)
{
    SIM_API(ctx_set_current(ctx));
}

static CUresult ctx_get_current(CUcontext *pctx)
{
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)current();
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx)
{
    SIM_API(ctx_get_current(pctx));
}

static CUresult ctx_push_api(CUcontext ctx)
{
    struct sim_ctx *c;

    sim_lock();
    c = sim_ctx_check(ctx);
    sim_unlock();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    return ctx_push(c);
}

CUresult CUDAAPI cuCtxPushCurrent_v2(CUcontext ctx)
{
    SIM_API(ctx_push_api(ctx));
}

static CUresult ctx_pop(CUcontext *pctx)
{
    if (tls.depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    tls.depth--;
    if (pctx)
        *pctx = (CUcontext)tls.stack[tls.depth];
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPopCurrent_v2(CUcontext *pctx)
{
    SIM_API(ctx_pop(pctx));
}

/* ctx NULL means the current one (the 13.0 _v2 forms take it explicitly). */
static CUresult ctx_device(CUdevice *device, CUcontext ctx)
{
    struct sim_ctx *c;

    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    c = ctx ? sim_ctx_check(ctx) : current();
    if (c && !c->used)
        c = NULL;
    if (c)
        *device = c->dev;
    sim_unlock();
    return c ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult CUDAAPI cuCtxGetDevice(CUdevice *device)
{
    SIM_API(ctx_device(device, NULL));
}

CUresult CUDAAPI cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    SIM_API(ctx_device(device, ctx));
}

static CUresult ctx_sync(CUcontext ctx)
{
    CUdevice d;
    CUresult r = ctx_device(&d, ctx);
    struct sim_ctx *c;

    if (r != CUDA_SUCCESS)
        return r;
    sim_lock();
    c = ctx ? sim_ctx_check(ctx) : current();
    sim_unlock();
    return c ? ctx_wait(c, 0) : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult CUDAAPI cuCtxSynchronize(void)
{
    SIM_API(ctx_sync(NULL));
}

CUresult CUDAAPI cuCtxSynchronize_v2(CUcontext ctx)
{
    SIM_API(ctx_sync(ctx));
}

static CUresult ctx_api_version(CUcontext ctx, unsigned int *version)
{
    CUdevice d;
    CUresult r;

    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    r = ctx_device(&d, ctx);
    if (r == CUDA_SUCCESS)
        *version = 3020;
    return r;
}

CUresult CUDAAPI cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    SIM_API(ctx_api_version(ctx, version));
}

static CUresult ctx_flags(unsigned int *flags)
{
    struct sim_ctx *c = current();

    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetFlags(unsigned int *flags)
{
    SIM_API(ctx_flags(flags));
}

static CUresult ctx_id(CUcontext ctx, unsigned long long *id)
{
    struct sim_ctx *c;

    if (!id)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    c = ctx ? sim_ctx_check(ctx) : current();
    if (c)
        *id = c->id;
    sim_unlock();
    return c ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult CUDAAPI cuCtxGetId(CUcontext ctx, unsigned long long *ctxId)
{
    SIM_API(ctx_id(ctx, ctxId));
}

/* ---- memory info ------------------------------------------------------ */

static CUresult mem_info(size_t *free_b, size_t *total_b)
{
    unsigned long long used;
    int dev;
    CUresult r;

    if (!free_b || !total_b)
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_current_dev(&dev);
    if (r != CUDA_SUCCESS)
        return r;
    used = sim_acct_used(dev);
    *total_b = sim.mem_total;
    *free_b = used >= sim.mem_total ? 0 : (size_t)(sim.mem_total - used);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetInfo_v2(size_t *free, size_t *total)
{
    SIM_API(mem_info(free, total));
}

/* ---- streams ---------------------------------------------------------- */

static CUresult stream_create(CUstream *ph, unsigned int flags, int priority)
{
    struct sim_ctx *c = current();
    struct sim_stream *s = NULL;

    if (!ph || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_lock();
    for (int i = 0; i < SIM_MAX_STREAMS && !s; i++)
        if (!sim.streams[i].used)
            s = &sim.streams[i];
    if (s) {
        s->used = 1;
        s->ctx = c;
        s->flags = flags;
        s->priority = priority;
    }
    sim_unlock();
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *ph = (CUstream)s;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    SIM_API(stream_create(phStream, Flags, 0));
}

CUresult CUDAAPI cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    SIM_API(stream_create(phStream, flags, priority));
}

static CUresult stream_destroy(CUstream h)
{
    struct sim_stream *s = (struct sim_stream *)h;
    CUresult r = CUDA_ERROR_INVALID_HANDLE;

    sim_lock();
    if (h && stream_valid(h) && h != CU_STREAM_LEGACY && h != CU_STREAM_PER_THREAD)
        r = CUDA_SUCCESS;
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    /* The driver lets queued work finish after destroy returns; here the
     * slot is only reused once it has (its worker stays, idle). */
    queue_wait(&s->queue);
    sim_lock();
    s->used = 0;
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuStreamDestroy_v2(CUstream hStream)
{
    SIM_API(stream_destroy(hStream));
}

/* The queue of `h` and its context; `*legacy` for the NULL stream (which
 * also waits for the context's blocking streams). */
static CUresult stream_queue(CUstream h, struct sim_queue **q, struct sim_ctx **c, int *legacy)
{
    CUresult r = CUDA_SUCCESS;

    sim_lock();
    if (!stream_valid(h)) {
        r = CUDA_ERROR_INVALID_HANDLE;
    } else if (special_stream(h)) {
        *c = current();
        *q = *c ? &(*c)->queue : NULL;
        *legacy = h != CU_STREAM_PER_THREAD;
        if (!*c)
            r = CUDA_ERROR_INVALID_CONTEXT;
    } else {
        *c = ((struct sim_stream *)h)->ctx;
        *q = &((struct sim_stream *)h)->queue;
        *legacy = 0;
    }
    sim_unlock();
    return r;
}

static CUresult stream_sync(CUstream h)
{
    struct sim_queue *q;
    struct sim_ctx *c;
    int legacy;
    CUresult r = stream_queue(h, &q, &c, &legacy);

    if (r != CUDA_SUCCESS)
        return r;
    if (legacy)
        return ctx_wait(c, 1);
    queue_wait(q);
    return (CUresult)atomic_load(&c->sticky);
}

static CUresult stream_query(CUstream h)
{
    struct sim_queue *q;
    struct sim_ctx *c;
    int legacy;
    CUresult r = stream_queue(h, &q, &c, &legacy);

    if (r != CUDA_SUCCESS)
        return r;
    r = (CUresult)atomic_load(&c->sticky);
    if (r == CUDA_SUCCESS && queue_busy(q))
        r = CUDA_ERROR_NOT_READY;
    return r;
}

CUresult CUDAAPI cuStreamSynchronize(CUstream hStream)
{
    SIM_API(stream_sync(hStream));
}

CUresult CUDAAPI cuStreamSynchronize_ptsz(CUstream hStream)
{
    SIM_API(stream_sync(sim_per_thread(hStream)));
}

CUresult sim_stream_wait(CUstream order)
{
    return stream_sync(order);
}

CUstream sim_per_thread(CUstream s)
{
    return s ? s : CU_STREAM_PER_THREAD;
}

CUresult CUDAAPI cuStreamQuery(CUstream hStream)
{
    SIM_API(stream_query(hStream));
}

static CUresult run_host_fn(struct sim_work *w)
{
    w->host_fn(w->host_arg);
    return CUDA_SUCCESS;
}

static CUresult launch_host_fn(CUstream h, CUhostFn fn, void *arg)
{
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_enqueue(h, &(struct sim_work){.run = run_host_fn, .host_fn = fn, .host_arg = arg});
}

CUresult CUDAAPI cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
    SIM_API(launch_host_fn(hStream, fn, userData));
}

CUresult CUDAAPI cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData)
{
    SIM_API(launch_host_fn(sim_per_thread(hStream), fn, userData));
}

/* Work that reached the callback ran without error (a failed context's
 * work is not queued). */
static CUresult run_callback(struct sim_work *w)
{
    w->callback(w->stream, CUDA_SUCCESS, w->host_arg);
    return CUDA_SUCCESS;
}

static CUresult add_callback(CUstream h, CUstreamCallback cb, void *arg, unsigned flags)
{
    if (!cb || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return sim_enqueue(h, &(struct sim_work){.run = run_callback, .callback = cb,
                                             .host_arg = arg, .stream = h});
}

CUresult CUDAAPI cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void *userData,
                                     unsigned int flags)
{
    SIM_API(add_callback(hStream, callback, userData, flags));
}

CUresult CUDAAPI cuStreamAddCallback_ptsz(CUstream hStream, CUstreamCallback callback,
                                          void *userData, unsigned int flags)
{
    SIM_API(add_callback(sim_per_thread(hStream), callback, userData, flags));
}

static struct sim_event *event_check(CUevent h);

/* The dependency is taken as met when queued: streams are not ordered
 * against each other (an event's own completion is: event_record). */
static CUresult stream_wait_event(CUstream s, CUevent h, unsigned flags)
{
    struct sim_event *e;
    CUresult r = sim_stream_check(s);

    if (r != CUDA_SUCCESS)
        return r;
    if (flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    e = event_check(h);
    sim_unlock();
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    SIM_API(stream_wait_event(hStream, hEvent, Flags));
}

CUresult CUDAAPI cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    SIM_API(stream_wait_event(sim_per_thread(hStream), hEvent, Flags));
}

static CUresult stream_ctx(CUstream h, CUcontext *pctx)
{
    struct sim_stream *s = (struct sim_stream *)h;
    CUresult r;

    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_stream_check(h);
    if (r != CUDA_SUCCESS)
        return r;
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        if (!current())
            return CUDA_ERROR_INVALID_CONTEXT;
        *pctx = (CUcontext)current();
    } else {
        *pctx = (CUcontext)s->ctx;
    }
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    SIM_API(stream_ctx(hStream, pctx));
}

static CUresult stream_flags(CUstream h, unsigned int *flags, int *prio)
{
    struct sim_stream *s = (struct sim_stream *)h;
    CUresult r = sim_stream_check(h);
    int special = h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD;

    if (r != CUDA_SUCCESS)
        return r;
    if (flags)
        *flags = special ? 0 : s->flags;
    if (prio)
        *prio = special ? 0 : s->priority;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamGetFlags(CUstream hStream, unsigned int *flags)
{
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_API(stream_flags(hStream, flags, NULL));
}

CUresult CUDAAPI cuStreamGetPriority(CUstream hStream, int *priority)
{
    if (!priority)
        return CUDA_ERROR_INVALID_VALUE;
    SIM_API(stream_flags(hStream, NULL, priority));
}

/* ---- events ----------------------------------------------------------- */

static struct sim_event *event_check(CUevent h)
{
    struct sim_event *e = (struct sim_event *)h;

    if (e >= &sim.events[0] && e < &sim.events[SIM_MAX_EVENTS] && e->used)
        return e;
    return NULL;
}

/* Events complete in stream order, as the driver's: a record queues a
 * marker behind the work already in the stream, and a synchronize (or a
 * query) looks at whether every marker recorded before it has run. A
 * slot's `gen` survives its reuse, so that a marker of a destroyed event
 * changes nothing. */
static pthread_mutex_t event_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t event_cv = PTHREAD_COND_INITIALIZER;

/* How often a wait for an interprocess event looks at its shared page
 * again: another process's marker cannot signal this one's condition. */
#define EVENT_POLL_NS 20000L

static void atomic_max(_Atomic uint64_t *v, uint64_t seq)
{
    uint64_t have = atomic_load(v);

    while (seq > have && !atomic_compare_exchange_weak(v, &have, seq))
        ;
}

/* event_mu held: what the event's records and completion are. */
static uint64_t recorded_of(const struct sim_event *e)
{
    return e->shared ? atomic_load(&e->shared->recorded) : e->recorded;
}

static uint64_t completed_of(const struct sim_event *e)
{
    return e->shared ? atomic_load(&e->shared->completed) : e->completed;
}

/* An interprocess event's marker carries its own mapping of the shared
 * page (`dst`): it completes the record even after this process destroyed
 * its handle, as the GPU completes it, for the other processes waiting. */
static CUresult run_event_mark(struct sim_work *w)
{
    struct sim_event *e = w->host_arg;
    struct sim_event_shared *sh = (struct sim_event_shared *)w->dst;

    pthread_mutex_lock(&event_mu);
    if (sh) {
        atomic_max(&sh->completed, w->value64);
        munmap(sh, sizeof(*sh));
    } else if (e->gen == w->value && w->value64 > e->completed) {
        e->completed = w->value64;
    }
    pthread_cond_broadcast(&event_cv);
    pthread_mutex_unlock(&event_mu);
    return CUDA_SUCCESS;
}

/* sim.mu held: the slot cleared, its next use a new generation. */
static void event_clear(struct sim_event *e)
{
    unsigned gen;

    pthread_mutex_lock(&event_mu);
    gen = e->gen;
    memset(e, 0, sizeof(*e));
    e->gen = gen + 1;
    pthread_mutex_unlock(&event_mu);
}

/* An interprocess event's state lives in a memfd page that the processes
 * holding the event map (ipc.c hands out the memfd). */
static CUresult event_shared_new(struct sim_event *e)
{
    struct sim_event_shared *sh;
    int fd = memfd_create("cuinterpose-sim-event", MFD_CLOEXEC);

    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)sizeof(*sh)) != 0)
        goto fail;
    sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (sh == MAP_FAILED)
        goto fail;
    sh->magic = SIM_EVENT_MAGIC;
    sh->creator_pid = (int32_t)getpid();
    e->fd = fd;
    e->shared = sh;
    return CUDA_SUCCESS;
fail:
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The slot's generation moves on first, under event_mu: a marker still
 * queued no longer touches the page unmapped after. */
static void event_release(struct sim_event *e)
{
    struct sim_event_shared *sh = e->shared;
    int fd = e->fd;

    event_clear(e);
    if (sh)
        munmap(sh, sizeof(*sh));
    if (fd >= 0)
        close(fd);
}

struct sim_event *sim_event_check(CUevent h)
{
    return event_check(h);
}

CUresult sim_event_new(unsigned flags, struct sim_event **out)
{
    struct sim_event *e = NULL;

    for (int i = 0; i < SIM_MAX_EVENTS && !e; i++)
        if (!sim.events[i].used)
            e = &sim.events[i];
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    event_clear(e);
    e->used = 1;
    e->flags = flags;
    e->t_ms = -1;
    e->fd = -1;
    *out = e;
    return CUDA_SUCCESS;
}

#define EVENT_FLAGS_KNOWN \
    ((unsigned)(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS))

static CUresult event_create(CUevent *ph, unsigned int flags)
{
    struct sim_event *e = NULL;
    CUresult r;

    if (!ph || (flags & ~EVENT_FLAGS_KNOWN))
        return CUDA_ERROR_INVALID_VALUE;
    /* An interprocess event cannot time (cuda.h). */
    if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE;
    if (!current())
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_lock();
    r = sim_event_new(flags, &e);
    if (r == CUDA_SUCCESS && (flags & CU_EVENT_INTERPROCESS)) {
        r = event_shared_new(e);
        if (r != CUDA_SUCCESS)
            event_release(e);
    }
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    *ph = (CUevent)e;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    SIM_API(event_create(phEvent, Flags));
}

static CUresult event_destroy(CUevent h)
{
    struct sim_event *e;

    sim_lock();
    e = event_check(h);
    if (e)
        event_release(e);
    sim_unlock();
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult CUDAAPI cuEventDestroy_v2(CUevent hEvent)
{
    SIM_API(event_destroy(hEvent));
}

static CUresult event_record(CUevent h, CUstream s)
{
    struct sim_event *e;
    CUresult r = sim_stream_check(s);

    if (r != CUDA_SUCCESS)
        return r;
    struct sim_event_shared *mark = NULL;
    uint64_t seq;
    unsigned gen;

    sim_lock();
    e = event_check(h);
    if (e)
        e->t_ms = sim_now_ms();
    sim_unlock();
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&event_mu);
    if (e->shared) {
        mark = mmap(NULL, sizeof(*mark), PROT_READ | PROT_WRITE, MAP_SHARED, e->fd, 0);
        if (mark == MAP_FAILED) {
            pthread_mutex_unlock(&event_mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    /* An interprocess event's record counts in every process holding it. */
    seq = e->shared ? atomic_fetch_add(&e->shared->recorded, 1) + 1 : ++e->recorded;
    gen = e->gen;
    pthread_mutex_unlock(&event_mu);
    r = sim_enqueue(s, &(struct sim_work){.run = run_event_mark, .host_arg = e, .value = gen,
                                          .value64 = seq, .dst = (uintptr_t)mark});
    if (r != CUDA_SUCCESS) {
        if (mark)
            munmap(mark, sizeof(*mark));
        pthread_mutex_lock(&event_mu);
        if (e->gen == gen && e->shared) {
            uint64_t mine = seq;

            atomic_compare_exchange_strong(&e->shared->recorded, &mine, seq - 1);
        } else if (e->gen == gen && e->recorded == seq) {
            e->recorded--;
        }
        pthread_mutex_unlock(&event_mu);
    }
    return r;
}

CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream)
{
    SIM_API(event_record(hEvent, hStream));
}

CUresult CUDAAPI cuEventRecord_ptsz(CUevent hEvent, CUstream hStream)
{
    SIM_API(event_record(hEvent, sim_per_thread(hStream)));
}

static CUresult event_record_flags(CUevent h, CUstream s, unsigned flags)
{
    if (flags & ~(unsigned)CU_EVENT_RECORD_EXTERNAL)
        return CUDA_ERROR_INVALID_VALUE;
    return event_record(h, s);
}

CUresult CUDAAPI cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
    SIM_API(event_record_flags(hEvent, hStream, flags));
}

CUresult CUDAAPI cuEventRecordWithFlags_ptsz(CUevent hEvent, CUstream hStream,
                                             unsigned int flags)
{
    SIM_API(event_record_flags(hEvent, sim_per_thread(hStream), flags));
}

/* NOT_READY while a marker recorded before the call has not run; with
 * `wait`, until it has. */
static CUresult event_wait(CUevent h, int wait)
{
    struct sim_event *e;
    uint64_t target;
    unsigned gen;
    CUresult r = CUDA_SUCCESS;

    sim_lock();
    e = event_check(h);
    sim_unlock();
    if (!e)
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&event_mu);
    target = recorded_of(e);
    gen = e->gen;
    while (wait && e->gen == gen && completed_of(e) < target) {
        if (e->shared) { /* its marker may run in another process */
            const struct timespec poll = {0, EVENT_POLL_NS};

            pthread_mutex_unlock(&event_mu);
            nanosleep(&poll, NULL);
            pthread_mutex_lock(&event_mu);
        } else {
            pthread_cond_wait(&event_cv, &event_mu);
        }
    }
    if (e->gen == gen && completed_of(e) < target)
        r = CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&event_mu);
    return r;
}

CUresult CUDAAPI cuEventQuery(CUevent hEvent)
{
    SIM_API(event_wait(hEvent, 0));
}

CUresult CUDAAPI cuEventSynchronize(CUevent hEvent)
{
    SIM_API(event_wait(hEvent, 1));
}

static CUresult event_elapsed(float *ms, CUevent a, CUevent b)
{
    struct sim_event *ea, *eb;
    CUresult r = CUDA_SUCCESS;

    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    ea = event_check(a);
    eb = event_check(b);
    if (!ea || !eb)
        r = CUDA_ERROR_INVALID_HANDLE;
    else if ((ea->flags | eb->flags) & CU_EVENT_DISABLE_TIMING)
        r = CUDA_ERROR_INVALID_HANDLE; /* cuda.h: such events do not time */
    else if (ea->t_ms < 0 || eb->t_ms < 0)
        r = CUDA_ERROR_INVALID_HANDLE;
    else
        *ms = (float)(eb->t_ms - ea->t_ms);
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    SIM_API(event_elapsed(pMilliseconds, hStart, hEnd));
}
