/* Internal interface of the simulated CUDA driver (libcuda.so.1).
 *
 * Model: device memory is host memory. A physical allocation is a memfd
 * whose last page (SIM_META_SIZE) holds its metadata, so that an exported
 * FD carries everything an importing process needs. Virtual address ranges
 * are real reservations of this process's address space (PROT_NONE), and a
 * mapping is the memfd mapped MAP_SHARED|MAP_FIXED over them: two processes
 * that map the same memfd share the same pages for real.
 *
 * All process-local bookkeeping lives in one struct (struct sim_state) of
 * fixed-size tables guarded by one mutex: no allocation in the hot paths. */
#ifndef CUINTERPOSE_SIM_H
#define CUINTERPOSE_SIM_H

/* Every function cuda.h declares is part of our exported ABI. */
#define __CUDA_API_PUSH_VISIBILITY_DEFAULT 1
#include <cuda.h>

/* Codes that CUDA 13.0's cuda.h (the real H200's toolkit) does not declare yet:
 * named by value so that the simulator builds against any 13.x header. */
/* The newest cuGetProcAddress version the resolver table answers:
 * cuda.bindings 13.5 asks up to 13050 (specs/records). */
#define SIM_NEWEST_API_VERSION 13050

#define SIM_ERROR_MULTICAST_RESOURCE_FULL ((CUresult)47)
#define SIM_ERROR_INSUFFICIENT_LOADER_VERSION ((CUresult)227)
#define SIM_ERROR_STREAM_DETACHED ((CUresult)917)
#define SIM_ERROR_GRAPH_RECAPTURE_FAILURE ((CUresult)918)
#define SIM_ERROR_FABRIC_NOT_READY ((CUresult)919)

/* The device-explicit binds arrived in CUDA 13.1's header; a matching
 * redeclaration is harmless where the header already has them. */
CUresult CUDAAPI cuMulticastBindMem_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                       size_t mcOffset, CUmemGenericAllocationHandle memHandle,
                                       size_t memOffset, size_t size, unsigned long long flags);
CUresult CUDAAPI cuMulticastBindAddr_v2(CUmemGenericAllocationHandle mcHandle, CUdevice dev,
                                        size_t mcOffset, CUdeviceptr memptr, size_t size,
                                        unsigned long long flags);

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define SIM_EXPORT __attribute__((visibility("default")))
#define SIM_HIDDEN __attribute__((visibility("hidden")))

#define SIM_DRIVER_VERSION 13000
#define SIM_DEVICE_NAME "cuinterpose simulated GPU"
#define SIM_MAX_DEVICES 8
#define SIM_DEFAULT_DEVICES 2
#define SIM_GRANULARITY ((size_t)2 << 20)
#define SIM_META_SIZE ((size_t)4096)
#define SIM_DEFAULT_MEM_MIB 143771ULL /* one H200, as its driver reports it */

/* Enough for the 2048 allocations of bench/staging.py's largest many-small shape
 * (and their mappings, twice over): the tables are scanned linearly. */
#define SIM_MAX_OBJS 4096
#define SIM_MAX_RESV 4096
#define SIM_MAX_MAPS 8192
#define SIM_MAX_HOST 512
#define SIM_MAX_ARRAYS 256
#define SIM_MAX_STREAMS 256
#define SIM_MAX_EVENTS 1024
#define SIM_MAX_CTXS 64
#define SIM_CTX_STACK 16
#define SIM_MC_MAX_BINDS 64
#define SIM_MAX_POOLS 64 /* created or imported pools, after each device's default */
#define SIM_PITCH_ALIGN ((size_t)512) /* cuMemAllocPitch's row alignment */
#define SIM_MAX_PITCH ((size_t)2147483647) /* CU_DEVICE_ATTRIBUTE_MAX_PITCH of an H200 */

#define SIM_META_MAGIC 0x4d495350u /* "PSIM" */
enum sim_kind { SIM_KIND_ALLOC = 1, SIM_KIND_MULTICAST = 2 };

/* An allocation's properties, as created (CUmemAllocationProp's fields). */
struct sim_props {
    uint32_t alloc_type;
    int32_t loc_type;
    int32_t loc_id;
    uint64_t handle_types;
    uint8_t compression;
    uint8_t rdma;
    uint16_t usage;
};

/* Lives in the last page of every memfd; shared by every process holding
 * the memfd. The fields before `lock` are written once by the creator
 * before any export; those after it (the multicast team) are guarded by it,
 * a robust, process-shared mutex. */
struct sim_meta {
    uint32_t magic;
    uint32_t kind;
    uint64_t size;       /* bytes of data before this page */
    int32_t creator_pid; /* process that created the object */
    struct sim_props props;
    /* The creator's id of the allocation (sim_obj.id), kept when a restore
     * gives it new memory: names it to legacy IPC (ipc.c). */
    uint64_t alloc_id;
    /* multicast team, guarded by `lock` */
    pthread_mutex_t lock;
    uint32_t num_devices;
    uint32_t added_mask; /* bit per device ordinal */
    uint32_t added_count;
    uint32_t nbinds;
    uint64_t mc_flags;
    struct sim_bind {
        int32_t dev;
        int32_t pid;
        uint64_t offset;
        uint64_t size;
        /* The bound member, as the binding process holds it: its memfd's
         * number there (checked against the inode before use) and the
         * offset in it. Writes through a multicast mapping reach it. */
        int32_t mem_fd;
        uint32_t reserved;
        uint64_t mem_ino;
        uint64_t mem_dev;
        uint64_t mem_offset;
    } binds[SIM_MC_MAX_BINDS];
};
_Static_assert(sizeof(struct sim_meta) <= SIM_META_SIZE, "meta must fit its page");

/* Where an allocation came from: VMM handles (cuMemCreate, an FD import)
 * are the driver's generic handles; the others are memory a pointer names
 * (freed by cuMemFree or cuIpcCloseMemHandle, not by cuMemRelease). */
enum sim_origin {
    SIM_FROM_VMM = 0,     /* cuMemCreate, cuMemImportFromShareableHandle */
    SIM_FROM_ALLOC,       /* cuMemAlloc, cuMemAllocPitch */
    SIM_FROM_POOL,        /* cuMemAllocAsync, cuMemAllocFromPoolAsync */
    SIM_FROM_IPC,         /* cuIpcOpenMemHandle: another process's cuMemAlloc memory */
    SIM_FROM_POOL_IMPORT, /* cuMemPoolImportPointer: another process's pool memory */
};

struct sim_pool;

/* cuMemAlloc requests below SIM_GRANULARITY share 2 MiB chunks, as on the
 * H200 (specs/records, sim/README.md "Packed allocations"): each takes whole
 * units of SIM_PACK_UNIT bytes, placed first-fit after the previous one
 * (two 4 KiB requests: B = A + 4096). A chunk is one allocation object of
 * the process (accounted, checkpointed and mapped as one); what each
 * request owns is kept here, per unit. */
#define SIM_PACK_UNIT ((size_t)512)
#define SIM_PACK_UNITS (SIM_GRANULARITY / SIM_PACK_UNIT)
struct sim_pack {
    uintptr_t base;      /* the chunk's VA (it keeps it through a checkpoint) */
    unsigned live;       /* allocations in the chunk */
    unsigned free_units;
    unsigned next;       /* where the next request is tried first */
    uint16_t owner[SIM_PACK_UNITS]; /* the unit's allocation: its first unit + 1; 0: free */
    struct sim_sub {
        uint64_t bytes;           /* as asked for; 0: no allocation starts here */
        unsigned long long id;    /* BUFFER_ID, MEMORY_BLOCK_ID, the IPC handle's */
    } sub[SIM_PACK_UNITS];        /* by first unit */
};

/* The allocation a pointer names around an address (sim_legacy_span). */
struct sim_span {
    uintptr_t base;
    uint64_t bytes;
    unsigned long long id;
};

/* A generic allocation handle: a physical allocation or a multicast object. */
struct sim_obj {
    int used;
    int kind;
    int fd;                     /* our own reference on the memfd */
    int imported;               /* came from cuMemImportFromShareableHandle */
    int foreign;                /* imported from another process */
    int legacy;                 /* not a VMM handle (origin other than SIM_FROM_VMM) */
    int origin;                 /* enum sim_origin */
    uint64_t bytes;             /* a pointer's allocation: the size asked for */
    struct sim_pack *pack;      /* a chunk of packed cuMemAlloc requests (bytes 0) */
    uint64_t sub_off;           /* SIM_FROM_IPC of a packed request: its offset in the chunk */
    struct sim_ctx *ctx;        /* the context it was allocated (or opened) in */
    struct sim_pool *pool;      /* SIM_FROM_POOL: the pool; POOL_IMPORT: the imported pool */
    unsigned long long id;      /* process-wide unique (BUFFER_ID, MEMORY_BLOCK_ID) */
    int ipc_refs;               /* SIM_FROM_IPC: opens not yet closed */
    /* SIM_FROM_IPC / POOL_IMPORT: the exporter's memfd as its handle named it */
    int32_t peer_pid;
    uint64_t peer_ino, peer_dev;
    int handle_refs;            /* create/import/retain minus release */
    int map_count;              /* mappings referencing it */
    CUmemGenericAllocationHandle handle;
    uint64_t size;
    struct sim_meta *meta;      /* shared page of the memfd */
    /* checkpoint: this process's reference dropped (fd -1, meta NULL);
     * owned allocations keep their bytes and properties for restore */
    void *saved;
    int released;
    struct sim_props props;
};

struct sim_resv {
    int used;
    uintptr_t base;
    size_t size;
};

struct sim_map {
    int used;
    uintptr_t va;
    size_t size;
    int obj;                  /* index in objs */
    size_t offset;
    int group;                /* the cuMemMap call it came from (splits share it) */
    int taken;                /* checkpoint took the pages away */
    uint8_t access[SIM_MAX_DEVICES]; /* CUmemAccess_flags per device */
};

/* A failure a test injects: calls to let through first, then the result the
 * next one returns (CUDA_SUCCESS: none armed). Under sim.mu. */
struct sim_fault {
    unsigned skip;
    CUresult result;
};

struct sim_host {
    int used;
    int registered; /* cuMemHostRegister (not ours to free) */
    void *p;
    size_t size;
    unsigned flags;
    struct sim_ctx *ctx; /* current when pinned: its destruction unpins (NULL: none) */
};

/* Device work queued on a stream (copies, memsets, host functions): run in
 * order by the queue's worker thread, as a GPU runs a stream's work after
 * the launching call returned. `run` answers the work's outcome; a failure
 * is the context's sticky error (an illegal address on the GPU). */
struct sim_work {
    struct sim_work *next;
    CUresult (*run)(struct sim_work *w);
    struct sim_ctx *ctx;
    int dev;
    uintptr_t dst, src;
    size_t n;
    unsigned value;
    size_t width;
    int dst_dev, src_dev;
    void (*host_fn)(void *);
    void *host_arg;
    CUstreamCallback callback; /* cuStreamAddCallback's, with host_arg */
    CUstream stream;           /* as the caller named it, for the callback */
    /* Copies of more than one row (2D, 3D): `n` bytes a row, `rows` rows a
     * slice, `slices` slices (0 reads as 1); each side's rows lie `pitch`
     * bytes apart and its slices `slice` bytes apart. */
    size_t rows, slices;
    size_t dst_pitch, src_pitch, dst_slice, src_slice;
    /* Stream memory operations (ordered.c). */
    uint64_t value64;
    unsigned flags;
};

struct sim_queue {
    int started;              /* under sim.mu: the worker runs; mu and cv are ready */
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* work queued, or work done */
    struct sim_work *head, *tail;
    unsigned long pending;    /* queued or running */
};

struct sim_ctx {
    struct sim_queue queue;   /* the NULL (legacy) stream's work */
    atomic_int sticky;        /* CUresult: device work failed; every sync reports it */
    int used;
    int primary;
    int dev;
    int refs;     /* primary: retain count */
    unsigned flags;
    unsigned long long id;
    /* cuCtxEnablePeerAccess: this context may access the cuMemAlloc memory
     * of the context in slot i (sim_ctx_slot) */
    uint8_t peer[SIM_MAX_DEVICES + SIM_MAX_CTXS];
};

struct sim_stream {
    struct sim_queue queue;
    int used;
    struct sim_ctx *ctx;
    unsigned flags;
    int priority;
};

/* A CUDA array: plain host memory of width x height elements (copy.c). */
struct sim_array {
    int used;
    void *p;
    size_t bytes;
    size_t row;    /* bytes a row: width x element size */
    size_t height; /* rows (1 for a 1D array) */
};

/* An interprocess event's state, in a memfd page every process that holds
 * the event maps (ipc.c). */
#define SIM_EVENT_MAGIC 0x56455053u /* "SPEV" */
struct sim_event_shared {
    uint32_t magic;
    int32_t creator_pid;
    /* Stream-ordered completion of the event's records, in any process
     * holding it (device.c): markers recorded, and the latest that ran. */
    _Atomic uint64_t recorded;
    _Atomic uint64_t completed;
};

struct sim_event {
    int used;
    unsigned flags;
    double t_ms;
    int opened;                      /* cuIpcOpenEventHandle */
    int fd;                          /* CU_EVENT_INTERPROCESS: the shared page's memfd */
    struct sim_event_shared *shared; /* mapped; NULL for a process-local event */
    /* Stream-ordered completion (device.c): markers recorded and run, and
     * the slot's use, so that a marker of a destroyed event is ignored. */
    unsigned gen;
    uint64_t recorded, completed;
};

/* Device-wide memory use, shared between every simulated process of one
 * namespace so that cuMemGetInfo shows memory a checkpoint freed. One slot
 * per process; a dead process's slot is reclaimed. */
#define SIM_ACCT_SLOTS 512
struct sim_acct_slot {
    atomic_int pid;
    int pad;
    atomic_ullong used[SIM_MAX_DEVICES];
};
struct sim_acct {
    struct sim_acct_slot slot[SIM_ACCT_SLOTS];
};

struct sim_state {
    pthread_mutex_t mu; /* tables below */
    pthread_once_t init_once;
    CUresult init_result;
    atomic_int initialized; /* read by every entry point, written once by cuInit */
    int ndev;
    uint64_t mem_total;
    /* Which node's GPUs this process sees (CUINTERPOSE_SIM_NODE, hashed: 0 for
     * none) and which of them each ordinal names: a restore with gpuPairs
     * changes the GPU behind an ordinal, never the ordinal (checkpoint.c). */
    uint64_t node;
    uint8_t gpu[SIM_MAX_DEVICES];
    char chip[64]; /* every device's name on this node (CUINTERPOSE_SIM_CHIP) */
    unsigned long long next_handle;
    unsigned long long next_ctx_id;
    int next_map_group;
    struct sim_obj objs[SIM_MAX_OBJS];
    struct sim_resv resv[SIM_MAX_RESV];
    struct sim_map maps[SIM_MAX_MAPS];
    struct sim_host host[SIM_MAX_HOST];
    struct sim_array arrays[SIM_MAX_ARRAYS];
    /* Each device's default pool, then created and imported ones (pool.c). */
    struct sim_pool {
        int used;    /* default: handed out by cuDeviceGetDefaultMemPool */
        int dev;
        int created; /* cuMemPoolCreate */
        int imported; /* cuMemPoolImportFromShareableHandle: allocates nothing */
        uint64_t handle_types;
        unsigned long long id; /* names the pool across processes: pid, number */
        int fd;      /* exportable: the token memfd an export dups (-1: none) */
    } pools[SIM_MAX_DEVICES + SIM_MAX_POOLS];
    unsigned long long next_obj_id;
    int pack_hint; /* the chunk (objs index) the last packed request went to */
    unsigned next_pool_number;
    struct sim_ctx primary[SIM_MAX_DEVICES];
    struct sim_ctx ctxs[SIM_MAX_CTXS];
    struct sim_stream streams[SIM_MAX_STREAMS];
    struct sim_event events[SIM_MAX_EVENTS];
    /* accounting */
    struct sim_acct *acct;
    struct sim_acct_slot *my_slot;
    unsigned long long local_used[SIM_MAX_DEVICES]; /* when the shared table is unavailable */
    /* checkpoint gate */
    pthread_mutex_t gate_mu;
    pthread_cond_t gate_cv;
    int ck_state;        /* CUprocessState */
    int lock_pending;    /* a lock is waiting for calls in flight */
    int in_flight;       /* API calls inside the driver */
    long work_us;        /* CUINTERPOSE_SIM_WORK_US: time each queued piece of work takes */
    atomic_int service_tid; /* published by the service thread once running */
    int service_fd;
    int restore_refused; /* restores refused so far (NOT_SUPPORTED once) */
    /* A test's injected failures (cuinterposeSimFailUnmap, cuinterposeSimFailCopy). */
    struct sim_fault fail_unmap, fail_copy;
    /* cuinterposeSimFailModule (sticky), cuinterposeSimFailLaunch (module.c). */
    struct sim_fault fail_module, fail_launch;
};

extern struct sim_state sim SIM_HIDDEN;

/* util.c */
SIM_HIDDEN CUresult sim_enter(void);
SIM_HIDDEN void sim_leave(void);
SIM_HIDDEN void sim_lock(void);
SIM_HIDDEN void sim_unlock(void);
SIM_HIDDEN long sim_env_long(const char *name, long def, long lo, long hi);
/* The UUID of GPU `gpu` of node `node` ("cuipsim", the node's 8 bytes, the GPU). */
SIM_HIDDEN void sim_gpu_uuid(uint64_t node, int gpu, char bytes[16]);
/* This process's node from the environment (CUINTERPOSE_SIM_NODE), hashed. */
SIM_HIDDEN uint64_t sim_env_node(void);
/* This node's chip name (CUINTERPOSE_SIM_CHIP appended to SIM_DEVICE_NAME). */
SIM_HIDDEN void sim_env_chip(char *out, size_t n);
SIM_HIDDEN double sim_now_ms(void);
SIM_HIDDEN int sim_is_aligned(uint64_t v, uint64_t a);
SIM_HIDDEN void sim_acct_init(void);
SIM_HIDDEN void sim_acct_add(int dev, long long delta);
SIM_HIDDEN int sim_pid_alive(int pid);
SIM_HIDDEN unsigned long long sim_acct_used(int dev);
/* A test's injected failure: arm `f` (skip calls, then fail one with
 * `result`); and, for each call it guards, the result to inject now, else
 * CUDA_SUCCESS (it disarms as it fires). sim.mu not held. */
SIM_HIDDEN void sim_fault_arm(struct sim_fault *f, unsigned skip, CUresult result);
SIM_HIDDEN CUresult sim_fault_due(struct sim_fault *f);

/* The body of every gated entry point: wait while the process is locked by
 * a checkpoint controller, count the call in flight, run it. */
#define SIM_API(call)                    \
    do {                                 \
        CUresult sim_r_ = sim_enter();   \
        if (sim_r_ != CUDA_SUCCESS)      \
            return sim_r_;               \
        sim_r_ = (call);                 \
        sim_leave();                     \
        return sim_r_;                   \
    } while (0)

/* device.c */
SIM_HIDDEN int sim_dev_valid(CUdevice dev);
SIM_HIDDEN CUresult sim_current_dev(int *dev);
SIM_HIDDEN struct sim_ctx *sim_ctx_check(CUcontext c);
/* The calling thread's current context, NULL when none (or destroyed). */
SIM_HIDDEN struct sim_ctx *sim_current_ctx(void);
SIM_HIDDEN int sim_ctx_slot(const struct sim_ctx *c);
/* sim.mu held: may device `dev` access the cuMemAlloc memory of `owner`
 * (its own device, or peer access enabled from a context of `dev`)? */
SIM_HIDDEN int sim_dev_sees_ctx(int dev, const struct sim_ctx *owner);
/* Events (sim.mu held): a live event, or NULL; a new one with `flags`. */
SIM_HIDDEN struct sim_event *sim_event_check(CUevent h);
SIM_HIDDEN CUresult sim_event_new(unsigned flags, struct sim_event **out);
SIM_HIDDEN CUresult sim_stream_check(CUstream s);
/* Queue a copy of `work` on stream `s` of the current context; its ctx and dev
 * are set here (dev: the context's device), the copy is freed once run. */
SIM_HIDDEN CUresult sim_enqueue(CUstream s, const struct sim_work *work);
/* Wait until the NULL stream's and every blocking stream's work of the
 * current context is done (what a legacy-stream synchronous call waits
 * for); the context's sticky error, if any. */
SIM_HIDDEN CUresult sim_legacy_wait(void);
/* Wait until the work a synchronous call is ordered after is done: stream
 * NULL is the legacy stream (as sim_legacy_wait), CU_STREAM_PER_THREAD the
 * calling thread's default stream (the _ptds variants); the context's
 * sticky error, if any. */
SIM_HIDDEN CUresult sim_stream_wait(CUstream order);
/* The stream a _ptsz variant means by `s`: NULL is the per-thread stream. */
SIM_HIDDEN CUstream sim_per_thread(CUstream s);

/* vmm.c (called with sim.mu held unless noted) */
SIM_HIDDEN struct sim_obj *sim_obj_find(CUmemGenericAllocationHandle h);
SIM_HIDDEN struct sim_map *sim_map_find(uintptr_t va);
SIM_HIDDEN void sim_obj_unref(struct sim_obj *o);
SIM_HIDDEN CUresult sim_obj_new(int kind, int fd, struct sim_meta *meta, uint64_t size,
                                struct sim_obj **out);
SIM_HIDDEN CUresult sim_alloc_memfd(uint64_t size, const struct sim_props *p, int *fd,
                                    struct sim_meta **meta_out);
SIM_HIDDEN CUresult sim_range_check(uintptr_t p, size_t n, int dev, int want_write);
/* The same for a copy: cuMemAlloc-like memory is copied from any device
 * (the driver stages what the device cannot reach). */
SIM_HIDDEN CUresult sim_copy_range_check(uintptr_t p, size_t n, int dev, int want_write);
SIM_HIDDEN int sim_is_device_ptr(uintptr_t p);
SIM_HIDDEN CUresult sim_map_apply_prot(struct sim_map *m);
/* cuMemAlloc / cuMemFree (sim.mu not held): also the stream-ordered ones,
 * and the pointers of pool imports. */
SIM_HIDDEN CUresult sim_mem_alloc(CUdeviceptr *dptr, size_t bytes);
/* `bytes` of memory named by a pointer (enum sim_origin), of the current
 * context (of `pool`'s device when given). */
SIM_HIDDEN CUresult sim_mem_alloc_from(CUdeviceptr *dptr, size_t bytes, int origin,
                                       struct sim_pool *pool);
/* An allocation FD someone handed over becomes an imported object (the FD
 * is taken, closed on failure). sim.mu not held. */
SIM_HIDDEN CUresult sim_obj_import_fd(int fd, struct sim_obj **out);
/* All of `o` mapped at a new VA, and back (sim.mu not held). */
SIM_HIDDEN CUresult sim_map_fresh(struct sim_obj *o, uintptr_t *va_out);
SIM_HIDDEN CUresult sim_unmap_fresh(uintptr_t va);
/* sim.mu held: peer access changed; cuMemAlloc mappings follow it. */
SIM_HIDDEN void sim_legacy_access_refresh(void);
SIM_HIDDEN CUresult sim_mem_free(CUdeviceptr dptr);
/* sim.mu held: the allocation a pointer names that holds `p`, mapped by `m`
 * (memory a pointer names only: o->legacy); 0 when `p` lies outside every
 * one (past what was asked for, a packed neighbour's or a free part). */
SIM_HIDDEN int sim_legacy_span(const struct sim_map *m, uintptr_t p, struct sim_span *s);
SIM_HIDDEN int sim_mem_is_alloc(CUdeviceptr dptr);

/* meta.c: the metadata page (sim.mu not needed: the page has its own lock) */
SIM_HIDDEN CUresult sim_memfd_new(const char *name, uint64_t size, int *fd_out,
                                  struct sim_meta **meta_out);
SIM_HIDDEN CUresult sim_meta_init_lock(struct sim_meta *m);
SIM_HIDDEN int sim_meta_lock(struct sim_meta *m);
SIM_HIDDEN void sim_meta_unlock(struct sim_meta *m);
SIM_HIDDEN CUresult sim_mc_wait_complete(struct sim_obj *mc);
SIM_HIDDEN void sim_mc_drop_binds(struct sim_obj *mc);
/* sim.mu held, after `n` bytes were written at device address `va`: the
 * part that lies in multicast mappings reaches every member bound there. */
SIM_HIDDEN CUresult sim_mc_mirror(uintptr_t va, size_t n);
/* Another process's FD `fd`, opened through /proc (same user) when it is
 * still the file of inode `ino` on `dev`; -1 otherwise. */
SIM_HIDDEN int sim_peer_fd_open(int32_t pid, int32_t fd, uint64_t ino, uint64_t dev);

/* checkpoint.c */
SIM_HIDDEN int sim_service_start(void);

/* Entry points whose ABI the 13.x header only declares for the driver's own
 * build (legacy versions still handed out by cuGetProcAddress). */
SIM_EXPORT CUresult CUDAAPI cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
/* cuIpcOpenMemHandle's 4.1 ABI under its exported name (the header maps
 * the name to _v2, whose signature is the same). */
SIM_EXPORT CUresult CUDAAPI sim_ipc_open_mem_v1(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                                unsigned int Flags) __asm__("cuIpcOpenMemHandle");
SIM_EXPORT int cuinterposeSimIsSimulated(void);
/* The 12.8 batch copies under their exported names (the header maps both
 * names to the 13.0 ABI, _v2). */
SIM_EXPORT CUresult CUDAAPI sim_memcpy_batch_v1(CUdeviceptr *dsts, CUdeviceptr *srcs,
                                                size_t *sizes, size_t count,
                                                CUmemcpyAttributes *attrs, size_t *attrsIdxs,
                                                size_t numAttrs, size_t *failIdx,
                                                CUstream hStream) __asm__("cuMemcpyBatchAsync");
SIM_EXPORT CUresult CUDAAPI sim_memcpy_3d_batch_v1(size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList,
                                                   size_t *failIdx, unsigned long long flags,
                                                   CUstream hStream)
    __asm__("cuMemcpy3DBatchAsync");

/* The stream memory operations of CUDA 8.0 to 11.6 (the header maps their
 * names to the _v2 ABI, whose signature is the same). */
#define SIM_MEMOP_V1(fn, name, vt)                                                        \
    SIM_EXPORT CUresult CUDAAPI fn(CUstream s, CUdeviceptr addr, vt value, unsigned int flags) \
        __asm__(name)
SIM_MEMOP_V1(sim_wait_value32_v1, "cuStreamWaitValue32", cuuint32_t);
SIM_MEMOP_V1(sim_wait_value32_v1_ptsz, "cuStreamWaitValue32_ptsz", cuuint32_t);
SIM_MEMOP_V1(sim_wait_value64_v1, "cuStreamWaitValue64", cuuint64_t);
SIM_MEMOP_V1(sim_wait_value64_v1_ptsz, "cuStreamWaitValue64_ptsz", cuuint64_t);
SIM_MEMOP_V1(sim_write_value32_v1, "cuStreamWriteValue32", cuuint32_t);
SIM_MEMOP_V1(sim_write_value32_v1_ptsz, "cuStreamWriteValue32_ptsz", cuuint32_t);
SIM_MEMOP_V1(sim_write_value64_v1, "cuStreamWriteValue64", cuuint64_t);
SIM_MEMOP_V1(sim_write_value64_v1_ptsz, "cuStreamWriteValue64_ptsz", cuuint64_t);
SIM_EXPORT CUresult CUDAAPI sim_batch_mem_op_v1(CUstream s, unsigned int count,
                                                CUstreamBatchMemOpParams *params,
                                                unsigned int flags) __asm__("cuStreamBatchMemOp");
SIM_EXPORT CUresult CUDAAPI sim_batch_mem_op_v1_ptsz(CUstream s, unsigned int count,
                                                     CUstreamBatchMemOpParams *params,
                                                     unsigned int flags)
    __asm__("cuStreamBatchMemOp_ptsz");

/* The per-thread default stream variants (cuda.h declares them only for the
 * driver's own build): _ptsz calls take NULL as the calling thread's
 * default stream, _ptds synchronous calls are ordered after that stream
 * instead of the legacy one. */
SIM_EXPORT CUresult CUDAAPI cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n,
                                               CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n,
                                                      CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n,
                                                      CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n,
                                                      CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D *p);
SIM_EXPORT CUresult CUDAAPI cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D *p);
SIM_EXPORT CUresult CUDAAPI cuMemcpy3D_v2_ptds(const CUDA_MEMCPY3D *p);
SIM_EXPORT CUresult CUDAAPI cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *p, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpy3DAsync_v2_ptsz(const CUDA_MEMCPY3D *p, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpyPeer_ptds(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src,
                                              CUcontext sctx, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyPeerAsync_ptsz(CUdeviceptr dst, CUcontext dctx,
                                                   CUdeviceptr src, CUcontext sctx, size_t n,
                                                   CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpy3DPeer_ptds(const CUDA_MEMCPY3D_PEER *p);
SIM_EXPORT CUresult CUDAAPI cuMemcpy3DPeerAsync_ptsz(const CUDA_MEMCPY3D_PEER *p, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpyBatchAsync_ptsz(CUdeviceptr *dsts, CUdeviceptr *srcs,
                                                    size_t *sizes, size_t count,
                                                    CUmemcpyAttributes *attrs, size_t *attrsIdxs,
                                                    size_t numAttrs, size_t *failIdx, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpyBatchAsync_v2_ptsz(CUdeviceptr *dsts, CUdeviceptr *srcs,
                                                       size_t *sizes, size_t count,
                                                       CUmemcpyAttributes *attrs,
                                                       size_t *attrsIdxs, size_t numAttrs,
                                                       CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpy3DBatchAsync_ptsz(size_t numOps, CUDA_MEMCPY3D_BATCH_OP *ops,
                                                      size_t *failIdx, unsigned long long flags,
                                                      CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemcpy3DBatchAsync_v2_ptsz(size_t numOps,
                                                         CUDA_MEMCPY3D_BATCH_OP *ops,
                                                         unsigned long long flags, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemsetD16_v2_ptds(CUdeviceptr d, unsigned short v, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int v, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n,
                                                 CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemsetD16Async_ptsz(CUdeviceptr d, unsigned short v, size_t n,
                                                  CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int v, size_t n,
                                                  CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemsetD2D8_v2_ptds(CUdeviceptr d, size_t pitch, unsigned char v,
                                                size_t w, size_t h);
SIM_EXPORT CUresult CUDAAPI cuMemsetD2D8Async_ptsz(CUdeviceptr d, size_t pitch, unsigned char v,
                                                 size_t w, size_t h, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemsetD2D16_v2_ptds(CUdeviceptr d, size_t pitch, unsigned short v,
                                                size_t w, size_t h);
SIM_EXPORT CUresult CUDAAPI cuMemsetD2D16Async_ptsz(CUdeviceptr d, size_t pitch, unsigned short v,
                                                 size_t w, size_t h, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemsetD2D32_v2_ptds(CUdeviceptr d, size_t pitch, unsigned int v,
                                                size_t w, size_t h);
SIM_EXPORT CUresult CUDAAPI cuMemsetD2D32Async_ptsz(CUdeviceptr d, size_t pitch, unsigned int v,
                                                 size_t w, size_t h, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuEventRecordWithFlags_ptsz(CUevent e, CUstream s, unsigned int f);
SIM_EXPORT CUresult CUDAAPI cuStreamAddCallback_ptsz(CUstream s, CUstreamCallback cb, void *arg,
                                                     unsigned int flags);
SIM_EXPORT CUresult CUDAAPI cuMemcpyAtoH_v2_ptds(void *d, CUarray a, size_t off, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyHtoA_v2_ptds(CUarray a, size_t off, const void *s, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyAtoD_v2_ptds(CUdeviceptr d, CUarray a, size_t off, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyDtoA_v2_ptds(CUarray a, size_t off, CUdeviceptr s, size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyAtoA_v2_ptds(CUarray d, size_t doff, CUarray s, size_t soff,
                                                 size_t n);
SIM_EXPORT CUresult CUDAAPI cuMemcpyAtoHAsync_v2_ptsz(void *d, CUarray a, size_t off, size_t n,
                                                      CUstream st);
SIM_EXPORT CUresult CUDAAPI cuMemcpyHtoAAsync_v2_ptsz(CUarray a, size_t off, const void *s,
                                                      size_t n, CUstream st);
SIM_EXPORT CUresult CUDAAPI cuStreamSynchronize_ptsz(CUstream s);
SIM_EXPORT CUresult CUDAAPI cuStreamWaitEvent_ptsz(CUstream s, CUevent e, unsigned int flags);
SIM_EXPORT CUresult CUDAAPI cuEventRecord_ptsz(CUevent e, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuLaunchHostFunc_ptsz(CUstream s, CUhostFn fn, void *arg);
SIM_EXPORT CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t n, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t n,
                                                         CUmemoryPool pool, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s);
SIM_EXPORT CUresult CUDAAPI cuStreamWaitValue32_v2_ptsz(CUstream s, CUdeviceptr addr,
                                                        cuuint32_t value, unsigned int flags);
SIM_EXPORT CUresult CUDAAPI cuStreamWaitValue64_v2_ptsz(CUstream s, CUdeviceptr addr,
                                                        cuuint64_t value, unsigned int flags);
SIM_EXPORT CUresult CUDAAPI cuStreamWriteValue32_v2_ptsz(CUstream s, CUdeviceptr addr,
                                                         cuuint32_t value, unsigned int flags);
SIM_EXPORT CUresult CUDAAPI cuStreamWriteValue64_v2_ptsz(CUstream s, CUdeviceptr addr,
                                                         cuuint64_t value, unsigned int flags);
SIM_EXPORT CUresult CUDAAPI cuStreamBatchMemOp_v2_ptsz(CUstream s, unsigned int count,
                                                       CUstreamBatchMemOpParams *params,
                                                       unsigned int flags);
/* For tests of the shim's error paths: let `skip` cuMemUnmap calls of this
 * process through, then fail the next one with `result` (nothing unmapped). */
SIM_EXPORT int cuinterposeSimFailUnmap(unsigned skip, CUresult result);
/* The same for cuMemcpyHtoDAsync: `skip` calls of this process through, from
 * any thread, then the next one fails with `result`, nothing queued. */
SIM_EXPORT int cuinterposeSimFailCopy(unsigned skip, CUresult result);
/* The same for cuLaunchKernel; cuModuleLoadData fails every call after `skip`
 * until called again with CUDA_SUCCESS (module.c). */
SIM_EXPORT int cuinterposeSimFailModule(unsigned skip, CUresult result);
SIM_EXPORT int cuinterposeSimFailLaunch(unsigned skip, CUresult result);
SIM_EXPORT CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy,
                                                unsigned gz, unsigned bx, unsigned by,
                                                unsigned bz, unsigned shared, CUstream s,
                                                void **params, void **extra);
/* For tests of QUIESCE (collective.c): a CUhostFn whose argument is one
 * rank's view of a collective; `arrived` (one word per rank) and `abandon`
 * lie in memory all ranks share. */
struct cuinterpose_sim_collective {
    uint64_t *arrived;
    uint32_t *abandon;
    uint32_t rank;
    uint32_t ranks;
};
SIM_EXPORT void cuinterposeSimCollective(void *arg);

#endif
