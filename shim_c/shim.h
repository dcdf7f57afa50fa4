/*
 * Internal interface of libcuinterpose.so (the LD_PRELOAD shim).
 *
 * The files, bottom to top: a file uses only the ones above it in this list
 * (tests/shim/test_c_layering.py checks it against CMakeLists.txt's order):
 *   util.c      logging, time, randomness, hex, byte comparisons
 *   settings.c  every environment variable, read once
 *   driver.c    the real driver: resolution, contexts, CUresult names
 *   gate.c      the gate that application calls pass (specs/quiesce.md)
 *   state.c     the shared state `g`, its lock, entering the shim
 *   handles.c   the logical handle table and its objects
 *   io.c        bounded socket I/O and replies
 *   capability.c, multicast.c, unicast.c   the tracked VMM calls and their
 *               phase work
 *   unowned.c, owned.c, ipc.c   sharing the shim refuses, cudaMalloc memory it
 *               owns, legacy IPC over tracked sharing
 *   staging.c, keep.c, content.c   the staging pool, the kept host copy
 *               (pinned for good, hashed on the GPU), SAVE and LOAD
 *   quiesce.c   QUIESCE: closing the gate until the process is quiet
 *   rollback.c  the way back to ACTIVE (CUIP_ROLLBACK_OPS)
 *   control.c   the control server: connections, validation, phase machine
 *   lifecycle.c starting the server, fork, exit
 *   interpose.c every way a program reaches the driver
 *
 * One state struct (struct shim_state, `g`) guarded by one mutex (g.lock).
 * Rules that every file follows:
 *  - g.lock is never held across a call to a peer (EXPORT) or across a
 *    driver call that may block (copies, synchronization). The application's
 *    own tracked calls hold it across their short, non-blocking driver call
 *    so that a phase change cannot interleave with them.
 *  - Outside ACTIVE the application cannot change tracked state (its tracked
 *    calls answer CUDA_ERROR_NOT_READY), so the control thread may work on
 *    objects without the lock; it still takes the lock to flip fields that
 *    the EXPORT server reads (live, real).
 *  - Only exported functions carry SHIM_EXPORT; everything else is hidden so
 *    the shim never interposes anything by accident.
 *  - A function returning int answers 0 on success and -1 on failure (errno
 *    or a message set), unless its declaration names another convention.
 */
#ifndef CUINTERPOSE_SHIM_H
#define CUINTERPOSE_SHIM_H

/* Every driver function the shim defines (cuMemCreate, cuGetProcAddress_v2,
 * ...) is exported with default visibility, as in libcuda itself. */
#define __CUDA_API_PUSH_VISIBILITY_DEFAULT 1
#include <cuda.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "protocol.h"

#define SHIM_EXPORT __attribute__((visibility("default")))
#define SHIM_HIDDEN __attribute__((visibility("hidden")))
/* Code that may run before the sanitizer runtime is initialised (libasan and
 * libtsan call dlsym while setting up their interceptors). */
#define SHIM_NO_SAN __attribute__((no_sanitize("address", "undefined", "thread")))


/* Headers older than CUDA 13.1 lack the device-explicit binds; cuda.h 13.5
 * has them, but declare the types here so the shim never depends on it. */
typedef CUresult (*shim_bind_mem_v2_fn)(CUmemGenericAllocationHandle, CUdevice, size_t,
                                        CUmemGenericAllocationHandle, size_t, size_t,
                                        unsigned long long);
typedef CUresult (*shim_bind_addr_v2_fn)(CUmemGenericAllocationHandle, CUdevice, size_t,
                                         CUdeviceptr, size_t, unsigned long long);
/* The shim's own device-explicit binds: declared here (and exported) because
 * cuda.h before 13.1 does not declare them; the real H200 runs driver 13.0. */
SHIM_EXPORT CUresult CUDAAPI cuMulticastBindMem_v2(CUmemGenericAllocationHandle mcHandle,
                                                   CUdevice dev, size_t mcOffset,
                                                   CUmemGenericAllocationHandle memHandle,
                                                   size_t memOffset, size_t size,
                                                   unsigned long long flags);
SHIM_EXPORT CUresult CUDAAPI cuMulticastBindAddr_v2(CUmemGenericAllocationHandle mcHandle,
                                                    CUdevice dev, size_t mcOffset,
                                                    CUdeviceptr memptr, size_t size,
                                                    unsigned long long flags);

/* ---------------------------------------------------------------- util.c */
enum { LOG_ERROR = 0, LOG_WARN = 1, LOG_INFO = 2, LOG_DEBUG = 3 };
SHIM_HIDDEN void shim_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* `n` bytes to stderr in one write, whatever the log level (never SIGPIPE). */
SHIM_HIDDEN void shim_write_line(const char *buf, size_t n);
/* Lines above `level` are dropped (LOG_WARN until the settings are read). */
SHIM_HIDDEN void shim_log_set_level(int level);
SHIM_HIDDEN uint64_t shim_now_ns(void);
static inline uint64_t ms_to_ns(uint64_t ms)
{
    return ms * 1000000ull;
}
SHIM_HIDDEN int shim_random(void *buf, size_t len);
SHIM_HIDDEN void shim_random_id(uint8_t id[CUIP_ID_LEN]);
SHIM_HIDDEN void shim_hex(char *out, const uint8_t *in, size_t len);
SHIM_HIDDEN bool shim_is_participant(const char *p);
SHIM_HIDDEN bool shim_is_zero(const void *p, size_t len);
/* `hexlen` lowercase hex digits of `in` as bytes in `out` (NULL: only
 * checked); false when `in` is not that. */
SHIM_HIDDEN bool shim_unhex(uint8_t *out, const char *in, size_t hexlen);
SHIM_HIDDEN bool shim_ct_equal(const void *a, const void *b, size_t len);

/* ---------------------------------------------------------------- settings.c */
/* What the environment asks for (every variable is read there, checked:
 * a bad value is named in a warning and the default is used). */
#define STAGING_DEPTH_MAX 8u
struct shim_settings {
    int log_level;              /* SNAPSHOT_SHIM_DEBUG: LOG_DEBUG, else LOG_WARN */
    long io_timeout_ms;         /* one control connection's read or write */
    long peer_timeout_ms;       /* a peer EXPORT request */
    /* SNAPSHOT_CONTENT_MODE=native: creators keep their shared allocations
     * through the native checkpoint (which moves the bytes); nothing is
     * copied. Importers tear down and rebuild the same in both modes. */
    bool native_content;
    unsigned copy_threads;      /* SAVE/LOAD: the staging pool's threads per phase */
    size_t copy_chunk;          /* bytes per copy chunk, at most */
    bool staging_thp;           /* SNAPSHOT_SHIM_STAGING_THP: MADV_HUGEPAGE on staging memory */
    size_t staging_bounce;      /* SNAPSHOT_SHIM_STAGING_BOUNCE_MIB: pinned bytes per thread,
                                 * 0: register the staging memory chunk by chunk */
    size_t staging_resident;    /* SNAPSHOT_SHIM_STAGING_RESIDENT_MIB: staging memory kept
                                 * across cycles, at most; 0: none */
    bool timing;                /* SNAPSHOT_SHIM_TIMING: one JSON line per SAVE/LOAD on stderr */
    /* SNAPSHOT_SHIM_STAGE_PRIVATE (default on): SAVE moves the private
     * allocations this process created too; off, they stay with the native
     * checkpoint (not reported, not torn down). */
    bool stage_private;
    /* SNAPSHOT_SHIM_STAGING_DEPTH: pieces per bounce buffer (copies in flight
     * per thread + 1), 2..STAGING_DEPTH_MAX. */
    unsigned staging_depth;
    /* SNAPSHOT_SHIM_STAGING_POPULATE_THREADS: SAVE threads that fault fresh
     * staging memory in ahead of the copies (0: the memcpy faults it). */
    unsigned staging_ahead;
    /* SNAPSHOT_SHIM_STAGING_CHUNKS_PER_THREAD: chunks per copy thread, about;
     * 0 when unset: each direction its own (staging.c). */
    unsigned staging_spread;
    /* SNAPSHOT_SHIM_STAGING_BOUNCE_KEEP (default on): the bounce buffers stay
     * pinned from one cycle to the next; off, LOAD frees them. */
    bool staging_bounce_keep;
    /* SNAPSHOT_SHIM_STAGING_RELEASE_AFTER_REPLY (default on): LOAD gives the
     * staged copies back to the kernel on a thread of its own after its
     * reply; off, inside the op, before it. */
    bool staging_release_after_reply;
    /* SNAPSHOT_SHIM_STAGING_BOUNCE_PIN=register: bounce buffers are mappings of
     * the shim's, populated then cuMemHostRegister'd; alloc (default):
     * cuMemHostAlloc'd. */
    bool staging_bounce_register;
    /* SNAPSHOT_SHIM_KEEP_HOST_COPY (default off): every allocation SAVE moves
     * has a pinned host copy, made in the background while the application
     * runs and kept across cycles; SAVE copies only the chunks whose hash
     * changed (keep.c). */
    bool keep_host_copy;
    char control_dir[4096];     /* as given (the default when unset); checked at start */
    /* SNAPSHOT_PARTICIPANT_ID as given, cut after one character too many so
     * that a long value still fails the length check; empty when unset. */
    char participant[CUIP_PARTICIPANT_LEN + 2];
    /* SNAPSHOT_LEASE_IDLE_S: a lease whose holder cannot be watched (its pid
     * is not visible in our pid namespace) lapses after this long without a
     * request from it. */
    long lease_idle_ms;
    /* SNAPSHOT_LEASE_HANDSHAKE_S: a lease whose holder sent nothing past
     * HANDSHAKE and INSPECT is another coordinator's to take this long after
     * it was taken (a stray HANDSHAKE must not hold the group). */
    long lease_handshake_ms;
#ifdef CUINTERPOSE_TEST_HOOKS
    /* Test hooks, in a test build only (CMake's CUINTERPOSE_TEST_HOOKS); a
     * release build warns that their variables are ignored.
     * SNAPSHOT_SHIM_TRUST_UID: the one uid trusted instead of root and our
     * own (peers, servers, the control dir's owner); -1 unset. */
    long trust_uid;
    /* SNAPSHOT_SHIM_TEST_RELEASE_DELAY_MS: the thread that frees a LOAD's
     * staged copies after the reply sleeps this long first, so that a test
     * sees the ops that must wait for it wait. */
    unsigned test_release_delay_ms;
    /* SNAPSHOT_SHIM_TEST_HOST_AVAILABLE_MIB (test hook, 0: unset): the host's
     * available and total memory as keep.c's bound reads them, instead of
     * /proc/meminfo, so that a test sees a pin refused. */
    size_t test_host_available;
    /* SNAPSHOT_SHIM_STAGING_PREFAULT: fault a SAVE chunk's staging memory in
     * before the bounce copies (off: the memcpy faults it). It measured no
     * faster (docs/benchmarks.md, "Issue 19 measured"), so it is no tuning
     * knob: a test sets it to see which SAVE found its memory populated. */
    bool staging_prefault;
#endif
    /* SNAPSHOT_SHIM_QUIESCE_TIMEOUT_S: QUIESCE's deadline for a quiet point. */
    long quiesce_timeout_ms;
    /* SNAPSHOT_SHIM_GATE=0 (diagnosis, and the test that shows what the gate
     * prevents): QUIESCE drains once and closes nothing. Warned at start. */
    bool gate;
    /* SNAPSHOT_SHIM_OWN_ALLOCATIONS=0: cuMemAlloc memory is the driver's, and
     * legacy IPC of it refuses the capture (owned.c, unowned.c). */
    bool own_allocations;
    /* SNAPSHOT_SHIM_OWN_SMALL=1: a request smaller than the granularity is
     * owned too, in a granularity of its own (owned.c). */
    bool own_small;
};
/* The settings, read from the environment on the first call. */
SHIM_HIDDEN const struct shim_settings *shim_settings(void);
/* Root or our own uid (in a test build, only SNAPSHOT_SHIM_TRUST_UID when
 * set): whom the shim trusts as a peer, a server, or the control dir's owner. */
SHIM_HIDDEN bool shim_trusted_uid(uid_t uid);

/* ---------------------------------------------------------------- driver.c */
/* The real driver's entry points. */
/* Every entry point `real` holds, once: X(field, parameters, exported name,
 * the resolver's base name or NULL, the resolver's version). The struct and
 * the resolver (driver.c) are both generated from it. The device-explicit
 * binds are asked for by name only: asking the resolver at 13010 could hand
 * back the old ABI on a 13.0 driver. cuGetProcAddress_v2 comes first: the
 * rest fall back to it. */
#define SHIM_REAL(X) \
    X(cuGetProcAddress_v2, (const char *, void **, int, cuuint64_t, \
      CUdriverProcAddressQueryResult *), \
      "cuGetProcAddress_v2", NULL, 0) \
    X(gpa_v1, (const char *, void **, int, cuuint64_t), "cuGetProcAddress", NULL, 0) \
    X(cuInit, (unsigned int), "cuInit", "cuInit", 2000) \
    X(cuGetErrorName, (CUresult, const char **), "cuGetErrorName", "cuGetErrorName", 6000) \
    X(cuMemCreate, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, \
      unsigned long long), \
      "cuMemCreate", "cuMemCreate", 10020) \
    X(cuMemRelease, (CUmemGenericAllocationHandle), "cuMemRelease", "cuMemRelease", 10020) \
    X(cuMemMap, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long), \
      "cuMemMap", "cuMemMap", 10020) \
    X(cuMemUnmap, (CUdeviceptr, size_t), "cuMemUnmap", "cuMemUnmap", 10020) \
    X(cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t), \
      "cuMemSetAccess", "cuMemSetAccess", 10020) \
    X(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle *, void *), \
      "cuMemRetainAllocationHandle", "cuMemRetainAllocationHandle", 11000) \
    X(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp *, \
      CUmemGenericAllocationHandle), \
      "cuMemGetAllocationPropertiesFromHandle", "cuMemGetAllocationPropertiesFromHandle", 10020) \
    X(cuMemExportToShareableHandle, (void *, CUmemGenericAllocationHandle, \
      CUmemAllocationHandleType, unsigned long long), \
      "cuMemExportToShareableHandle", "cuMemExportToShareableHandle", 10020) \
    X(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle *, void *, \
      CUmemAllocationHandleType), \
      "cuMemImportFromShareableHandle", "cuMemImportFromShareableHandle", 10020) \
    X(cuMemAddressReserve, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long), \
      "cuMemAddressReserve", "cuMemAddressReserve", 10020) \
    X(cuMemAddressFree, (CUdeviceptr, size_t), "cuMemAddressFree", "cuMemAddressFree", 10020) \
    X(cuMemHostAlloc, (void **, size_t, unsigned int), "cuMemHostAlloc", "cuMemHostAlloc", 2020) \
    X(cuMemFreeHost, (void *), "cuMemFreeHost", "cuMemFreeHost", 2000) \
    X(cuMemcpyDtoHAsync, (void *, CUdeviceptr, size_t, CUstream), \
      "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync", 3020) \
    X(cuMemcpyHtoDAsync, (CUdeviceptr, const void *, size_t, CUstream), \
      "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync", 3020) \
    X(cuStreamCreate, (CUstream *, unsigned int), "cuStreamCreate", "cuStreamCreate", 2000) \
    X(cuStreamSynchronize, (CUstream), "cuStreamSynchronize", "cuStreamSynchronize", 2000) \
    X(cuStreamDestroy, (CUstream), "cuStreamDestroy_v2", "cuStreamDestroy", 4000) \
    X(cuEventCreate, (CUevent *, unsigned int), "cuEventCreate", "cuEventCreate", 2000) \
    X(cuEventRecord, (CUevent, CUstream), "cuEventRecord", "cuEventRecord", 2000) \
    X(cuEventSynchronize, (CUevent), "cuEventSynchronize", "cuEventSynchronize", 2000) \
    X(cuEventDestroy, (CUevent), "cuEventDestroy_v2", "cuEventDestroy", 4000) \
    X(cuCtxGetCurrent, (CUcontext *), "cuCtxGetCurrent", "cuCtxGetCurrent", 4000) \
    X(cuCtxPushCurrent, (CUcontext), "cuCtxPushCurrent_v2", "cuCtxPushCurrent", 4000) \
    X(cuCtxPopCurrent, (CUcontext *), "cuCtxPopCurrent_v2", "cuCtxPopCurrent", 4000) \
    X(cuCtxGetDevice, (CUdevice *), "cuCtxGetDevice", "cuCtxGetDevice", 2000) \
    X(cuCtxSynchronize, (void), "cuCtxSynchronize", "cuCtxSynchronize", 2000) \
    X(cuDeviceGetCount, (int *), "cuDeviceGetCount", "cuDeviceGetCount", 2000) \
    X(cuDeviceGetUuid, (CUuuid *, CUdevice), "cuDeviceGetUuid_v2", "cuDeviceGetUuid", 11040) \
    X(cuDeviceGetName, (char *, int, CUdevice), "cuDeviceGetName", "cuDeviceGetName", 2000) \
    X(cuDevicePrimaryCtxGetState, (CUdevice, unsigned int *, int *), \
      "cuDevicePrimaryCtxGetState", "cuDevicePrimaryCtxGetState", 7000) \
    X(cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice), \
      "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", 7000) \
    X(cuDevicePrimaryCtxRelease, (CUdevice), \
      "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease", 11000) \
    X(cuMemAlloc, (CUdeviceptr *, size_t), "cuMemAlloc_v2", "cuMemAlloc", 3020) \
    X(cuMemAllocPitch, (CUdeviceptr *, size_t *, size_t, size_t, unsigned int), \
      "cuMemAllocPitch_v2", "cuMemAllocPitch", 3020) \
    X(cuMemFree, (CUdeviceptr), "cuMemFree_v2", "cuMemFree", 3020) \
    X(cuMemGetAddressRange, (CUdeviceptr *, size_t *, CUdeviceptr), \
      "cuMemGetAddressRange_v2", "cuMemGetAddressRange", 3020) \
    X(cuMemGetAllocationGranularity, (size_t *, const CUmemAllocationProp *, \
      CUmemAllocationGranularity_flags), \
      "cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity", 10020) \
    X(cuPointerGetAttribute, (void *, CUpointer_attribute, CUdeviceptr), \
      "cuPointerGetAttribute", "cuPointerGetAttribute", 4000) \
    X(cuPointerGetAttributes, (unsigned int, CUpointer_attribute *, void **, CUdeviceptr), \
      "cuPointerGetAttributes", "cuPointerGetAttributes", 7000) \
    X(cuCtxDestroy, (CUcontext), "cuCtxDestroy_v2", "cuCtxDestroy", 4000) \
    X(cuDevicePrimaryCtxReset, (CUdevice), \
      "cuDevicePrimaryCtxReset_v2", "cuDevicePrimaryCtxReset", 11000) \
    X(cuCtxEnablePeerAccess, (CUcontext, unsigned int), \
      "cuCtxEnablePeerAccess", "cuCtxEnablePeerAccess", 4000) \
    X(cuCtxDisablePeerAccess, (CUcontext), \
      "cuCtxDisablePeerAccess", "cuCtxDisablePeerAccess", 4000) \
    X(cuIpcGetMemHandle, (CUipcMemHandle *, CUdeviceptr), \
      "cuIpcGetMemHandle", "cuIpcGetMemHandle", 4010) \
    X(cuIpcOpenMemHandle, (CUdeviceptr *, CUipcMemHandle, unsigned int), \
      "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle", 11000) \
    X(cuIpcOpenMemHandle_v1, (CUdeviceptr *, CUipcMemHandle, unsigned int), \
      "cuIpcOpenMemHandle", NULL, 0) \
    X(cuIpcCloseMemHandle, (CUdeviceptr), "cuIpcCloseMemHandle", "cuIpcCloseMemHandle", 4010) \
    X(cuMemPoolExportToShareableHandle, (void *, CUmemoryPool, CUmemAllocationHandleType, \
      unsigned long long), \
      "cuMemPoolExportToShareableHandle", "cuMemPoolExportToShareableHandle", 11020) \
    X(cuMemPoolImportFromShareableHandle, (CUmemoryPool *, void *, CUmemAllocationHandleType, \
      unsigned long long), \
      "cuMemPoolImportFromShareableHandle", "cuMemPoolImportFromShareableHandle", 11020) \
    X(cuMemPoolExportPointer, (CUmemPoolPtrExportData *, CUdeviceptr), \
      "cuMemPoolExportPointer", "cuMemPoolExportPointer", 11020) \
    X(cuMemPoolImportPointer, (CUdeviceptr *, CUmemoryPool, CUmemPoolPtrExportData *), \
      "cuMemPoolImportPointer", "cuMemPoolImportPointer", 11020) \
    X(cuMemPoolDestroy, (CUmemoryPool), "cuMemPoolDestroy", "cuMemPoolDestroy", 11020) \
    X(cuMulticastCreate, (CUmemGenericAllocationHandle *, const CUmulticastObjectProp *), \
      "cuMulticastCreate", "cuMulticastCreate", 12010) \
    X(cuMulticastAddDevice, (CUmemGenericAllocationHandle, CUdevice), \
      "cuMulticastAddDevice", "cuMulticastAddDevice", 12010) \
    X(cuMulticastBindMem, (CUmemGenericAllocationHandle, size_t, CUmemGenericAllocationHandle, \
      size_t, size_t, unsigned long long), \
      "cuMulticastBindMem", "cuMulticastBindMem", 12010) \
    X(cuMulticastBindAddr, (CUmemGenericAllocationHandle, size_t, CUdeviceptr, size_t, \
      unsigned long long), \
      "cuMulticastBindAddr", "cuMulticastBindAddr", 12010) \
    X(cuMulticastUnbind, (CUmemGenericAllocationHandle, CUdevice, size_t, size_t), \
      "cuMulticastUnbind", "cuMulticastUnbind", 12010) \
    X(cuMulticastBindMem_v2, (CUmemGenericAllocationHandle, CUdevice, size_t, \
      CUmemGenericAllocationHandle, size_t, size_t, unsigned long long), \
      "cuMulticastBindMem_v2", NULL, 0) \
    X(cuMulticastBindAddr_v2, (CUmemGenericAllocationHandle, CUdevice, size_t, CUdeviceptr, \
      size_t, unsigned long long), \
      "cuMulticastBindAddr_v2", NULL, 0)

#define SHIM_REAL_FIELD(field, params, name, base, version) CUresult(*field) params;
struct shim_real {
    SHIM_REAL(SHIM_REAL_FIELD)
    /* Not wrapped: resolved on first use by shim_resolve_host_register(). */
    CUresult (*cuMemHostRegister)(void *, size_t, unsigned int);
    CUresult (*cuMemHostUnregister)(void *);
};
extern SHIM_HIDDEN struct shim_real real;
/* Resolves `real` from libcuda.so.1 (never linked); false if the driver is
 * not loadable. Safe to call repeatedly and from any thread. */
SHIM_HIDDEN bool shim_resolve_real(void);
/* cuMemHostRegister and cuMemHostUnregister, through the driver's resolver
 * as an application would ask; false when the driver lacks either. */
SHIM_HIDDEN bool shim_resolve_host_register(void);
/* The driver's own export `name` (exact symbol name, no resolver); NULL
 * when the driver cannot be loaded or lacks it. */
SHIM_HIDDEN void *shim_driver_symbol(const char *name);
/* The path the loader gave the libcuda.so.1 that `real` comes from; "" while
 * none is loaded (the application has not reached the driver yet). Never
 * loads the driver itself. */
SHIM_HIDDEN const char *shim_driver_path(void);
/* The real dlsym (found with dlvsym: a dlsym interposer cannot ask dlsym);
 * NULL when none of the known versions exists. */
typedef void *(*shim_dlsym_fn)(void *, const char *);
SHIM_HIDDEN shim_dlsym_fn shim_real_dlsym(void);
/* Enter `ctx` on the calling (control) thread; a NULL ctx enters nothing. */
SHIM_HIDDEN CUresult shim_ctx_enter(CUcontext ctx, bool *pushed);
SHIM_HIDDEN void shim_ctx_leave(bool pushed);
SHIM_HIDDEN const char *shim_cu_name(CUresult r);
/* A CUDA_FAILED message: "<call> failed: <CUresult name> (<value>)". */
SHIM_HIDDEN void shim_fail(char *msg, size_t n, const char *call, CUresult r);

/* ---------------------------------------------------------------- gate.c */
/* What a gated call does: launches device work, or waits for it on the
 * host (specs/quiesce.md lists the calls). */
enum gate_class { GATE_LAUNCH = 0, GATE_SYNC = 1, GATE_CLASSES = 2 };
enum gate_level {
    GATE_OPEN = 0,      /* every call passes */
    GATE_HOLD_SYNC = 1, /* launches pass; synchronizing calls are held */
    GATE_HOLD_ALL = 2,  /* every gated call is held */
};
/* Around an application's driver call of class `c` named `call` (a string
 * that outlives the call): blocks while the gate holds `c`, never failing. */
SHIM_HIDDEN void gate_enter(enum gate_class c, const char *call);
SHIM_HIDDEN void gate_leave(enum gate_class c);
/* Sets the level (closing, or from HOLD_ALL back to HOLD_SYNC). */
SHIM_HIDDEN void gate_close(enum gate_level level);
/* Back to HOLD_SYNC, and every thread held at a synchronizing call may make
 * exactly that call, then is held at its next one: the process advances by
 * one synchronization (specs/quiesce.md). The threads granted. */
SHIM_HIDDEN unsigned gate_advance(void);
/* Until every granted call is in flight, or the monotonic `deadline_ns`. */
SHIM_HIDDEN bool gate_wait_passes(uint64_t deadline_ns);
/* The threads held at the gate now. */
SHIM_HIDDEN unsigned gate_held(void);
/* Lets every held thread go. */
SHIM_HIDDEN void gate_open(void);
SHIM_HIDDEN enum gate_level gate_level(void);
/* Waits until no gated call is inside the driver (held ones are not) and
 * every granted pass is taken, until
 * the monotonic `deadline_ns`; false when some still are. */
SHIM_HIDDEN bool gate_wait_calls(uint64_t deadline_ns);
/* Who is held at which call and what is still inside the driver, in one
 * line; its length. */
SHIM_HIDDEN size_t gate_describe(char *buf, size_t n);
/* `watch` is called every 200 ms by a held thread, without any lock held. */
SHIM_HIDDEN void gate_set_watch(void (*watch)(void));
SHIM_HIDDEN void gate_after_fork(void);

/* ---------------------------------------------------------------- state.c */
/* The coordinator's lease (control.c): one coordinator at a time. The word
 * "claim" is the pinned participant id's (lifecycle.c). */
struct shim_lease {
    bool held;
    uint8_t token[CUIP_AUTH_LEN];
    pid_t pid;             /* the holder as SO_PEERCRED showed it; 0: not visible here */
    int pidfd;             /* watches `pid` (pidfd_open); -1 when unavailable */
    int64_t since_s;       /* wall clock when taken, for messages */
    uint64_t taken_ns;     /* monotonic: when taken */
    uint64_t last_ns;      /* monotonic: the holder's latest request */
    bool acting;           /* the holder sent an op past HANDSHAKE and INSPECT */
};

struct shim_state {
    pthread_mutex_t lock;          /* tables, phase, reason */
    pthread_mutex_t init_lock;     /* lazy start */
    pid_t started_pid;             /* the pid that owns the listener; 0 = not started */
    char participant[CUIP_PARTICIPANT_LEN + 1];
    bool pinned;                   /* id from SNAPSHOT_PARTICIPANT_ID */
    uint16_t phase;                /* enum cuip_phase */
    bool busy;                     /* a phase op is running */
    uint16_t op_in_flight;         /* that op (enum cuip_op), 0 when none; for STATUS */
    uint64_t op_started_ns;        /* when it started */
    /* The deadline the coordinator gave the QUIESCE about to run (ns; 0: none,
     * the setting's), and whether it is a round (PENDING when not quiet);
     * set under g.lock before it starts. */
    uint64_t quiesce_deadline_ns;
    bool quiesce_round;
    /* When the gate closed for the capture being quiesced: the shim's own
     * deadline counts from there across rounds. */
    uint64_t quiesce_started_ns;
    unsigned quiesce_advances;     /* advances since then */
    /* A restore or rollback brought the shim back to ACTIVE while a lease was
     * held: the gate stays closed until the holder's RELEASE (its last
     * INSPECT and VERIFY done) or its lease's end, so that no held call of
     * the application changes the topology being verified. */
    bool hold_for_verify;
    /* The bytes the phase op in flight has copied and will copy in all:
     * reset at its start (g.lock held), the total set by content.c, the
     * bytes done added without the lock by staging.c once per copied chunk
     * (__atomic_fetch_add), and read by STATUS
     * with __atomic_load_n while the op runs. */
    uint64_t phase_bytes_done;
    uint64_t phase_bytes_total;
    /* Bumped (under lock) whenever an object is made or freed: the kept host
     * copy's thread (keep.c) looks again at the table when it moved. */
    uint64_t objs_gen;
    char reason[CUIP_MESSAGE_MAX + 1];
    int listen_fd;
    char control_dir[108];
    char sock_name[CUIP_CAP_ENDPOINT_LEN];
    char sock_path[108];
    char claim_path[160];
    struct shim_lease lease;       /* under lock */
};
extern SHIM_HIDDEN struct shim_state g;

/* How the process becomes a participant (lifecycle.c registers it from its
 * constructor): the state knows that something starts, not what. A start
 * asked for before the registration happens at the registration. */
SHIM_HIDDEN void shim_set_starter(void (*start)(void));
/* Start the control server once per process (fork children included). */
SHIM_HIDDEN void shim_ensure_started(void);
/* Every tracked application call starts with this: resolves the driver and
 * starts the control server. Returns CUDA_SUCCESS or an error to hand back. */
SHIM_HIDDEN CUresult shim_enter(void);
/* Pass the gate (a launching call named `call`) and lock g.lock. */
SHIM_HIDDEN void app_gate_lock(const char *call);
/* Enter the shim, pass the gate, lock g.lock and check that the application
 * may change tracked state; on CUDA_SUCCESS the caller holds g.lock. */
SHIM_HIDDEN CUresult app_lock_at(const char *call);
#define app_lock() app_lock_at(__func__)
/* app_lock for a call that needs the driver's entry point *fn (resolved by then):
 * CUDA_ERROR_NOT_SUPPORTED, unlocked, when the driver lacks it. */
SHIM_HIDDEN CUresult app_lock_driver(const char *call, void *const *fn);
#define app_lock_for(fn) app_lock_driver(__func__, (void *const *)&(fn))
/* Fork child, before anything else runs: fresh locks, phase ACTIVE, no id,
 * not started. */
SHIM_HIDDEN void shim_state_after_fork(void);

/* ---------------------------------------------------------------- handles.c */
/* A logical handle: bits 63..48 the tag, 47..24 the slot's generation,
 * 23..0 the slot. Real driver handles observed on the H200 are small
 * (e.g. 0x204b0840); one with this tag is refused at creation. */
/* Device ordinals the shim keeps a bit for (uint64_t masks: owned.c's peers,
 * multicast.c's devices). */
#define MAX_DEVICES 64

#define SHIM_TAG 0xC1F0ull
#define SHIM_TAG_SHIFT 48
#define SHIM_GEN_SHIFT 24
#define SHIM_GEN_MASK 0xFFFFFFu
#define SHIM_SLOT_MASK 0xFFFFFFu
#define SHIM_IS_TAGGED(h) (((uint64_t)(h) >> SHIM_TAG_SHIFT) == SHIM_TAG)

enum obj_kind { OBJ_FREE = 0, OBJ_ALLOC = 1, OBJ_MC = 2 };

/* A participant that fetched an export of a creator's allocation. */
struct fetch {
    char participant[CUIP_PARTICIPANT_LEN];
    pid_t pid;                    /* SO_PEERCRED on the EXPORT connection; 0: not visible */
};

struct mapping {
    CUdeviceptr va;
    size_t size;
    size_t offset;
    unsigned long long flags;
    uint32_t access_count;                   /* merged per location, sorted */
    struct cuip_access access[CUIP_ACCESS_MAX];
};

/* One binding this process made into a multicast object (multicast.c). */
struct mc_binding {
    uint8_t kind;                 /* enum cuip_binding_kind */
    uint8_t api_version;          /* 1, or 2 for the device-explicit binds */
    bool bound;                   /* held by the driver now (false while torn down) */
    CUdevice device;              /* the v2 argument, or the member's own device */
    uint64_t mc_offset;
    uint64_t size;
    uint8_t member_id[CUIP_ID_LEN]; /* all zero: not a tracked allocation */
    uint64_t member_offset;
    CUdeviceptr address;          /* BIND_ADDR */
    unsigned long long flags;
};

struct obj {
    uint32_t slot;
    uint32_t gen;
    uint8_t kind;                 /* enum obj_kind */
    uint8_t id[CUIP_ID_LEN];      /* random, never zero; survives restore */
    char creator[CUIP_PARTICIPANT_LEN];
    bool is_creator;
    bool exported;                /* a capability was handed out */
    bool imported;                /* imported from a capability */
    bool mc_member;               /* bound into a multicast object */
    bool raw_import;              /* imported from an FD that is not a capability */
    bool unsupported;             /* exportable through a handle type other than POSIX FD */
    bool live;                    /* `real` is a valid driver handle */
    CUmemGenericAllocationHandle real;
    CUcontext ctx;                /* current at creation; the control thread enters it */
    CUmemAllocationProp prop;     /* original properties (win32 metadata cleared) */
    CUmulticastObjectProp mcprop; /* OBJ_MC */
    uint64_t size;
    uint64_t handle_types;
    uint32_t refs;                /* application handles (create/import/retain) */
    uint8_t auth[CUIP_AUTH_LEN];  /* capability authorization (creator: generated) */
    bool has_auth;
    char endpoint[CUIP_CAP_ENDPOINT_LEN]; /* importer: creator's socket name */
    struct mapping *maps;
    uint32_t nmaps, capmaps;
    struct fetch *fetches;        /* creator: who fetched an export (EXPORT served) */
    uint32_t nfetches, capfetches;
    void *host;                   /* SAVE_ALLOCATIONS copy: anonymous mapping of `size` bytes */
    /* OBJ_MC: the team as this process built it (multicast.c). */
    uint64_t mc_devices;          /* bit per device this process added */
    bool mc_joined;               /* those devices are added to `real` */
    bool mc_mapped;               /* the mappings are mapped on `real` */
    struct mc_binding *binds;
    uint32_t nbinds, capbinds;
    size_t host_len;              /* bytes mapped at `host` (staging_len(size)) */
    bool host_kept;               /* `host` is the kept host copy's (keep.c): never unmapped */
    /* STORE_STAGED wrote the staged copy to the coordinator's file and freed
     * `host`; FETCH_STAGED reads it back (stored.c). */
    bool stored;
    /* Memory the shim owns for the application (owned.c): a cuMemAlloc
     * allocation the shim backs with this object (its creator), or the
     * ranges this process opened by cuIpcOpenMemHandle (an importer). NULL
     * for the application's own VMM objects. */
    struct owned *own;
    void (*free_own)(struct owned *); /* owned.c's: set with `own` (owned_new) */
};

/* One range the application holds a pointer to: what cuMemAlloc returned
 * (creator), or what cuIpcOpenMemHandle returned (importer; `opens` times). */
struct owned_range {
    uint64_t offset;              /* from the object's mapping */
    uint64_t size;                /* as asked (cuMemGetAddressRange answers it) */
    uint32_t opens;               /* importer: opens not yet closed */
    bool live;                    /* creator: not freed yet */
};

/* The shim's bookkeeping of an owned object (owned.c). */
struct owned {
    CUdeviceptr base;             /* the reservation the shim made (the mapping's VA) */
    size_t reserved;              /* its size */
    struct owned_range *ranges;
    uint32_t nranges, capranges;
    /* BUFFER_ID and MEMORY_BLOCK_ID as first answered (0: not asked yet),
     * answered from then on: a restore rebuilds the memory under new ids,
     * and the native checkpoint keeps them. */
    uint64_t buffer_id, block_id;
};

/* The application's cuMemUnmap, cuMemAddressFree, cuMemSetAccess and
 * cuMemRetainAllocationHandle of owned memory fail as they would on
 * cuMemAlloc memory. */
static inline bool obj_owned(const struct obj *o)
{
    return o->own != NULL;
}

/* Allocate a fresh object and its logical handle; NULL on ENOMEM. */
SHIM_HIDDEN struct obj *obj_new(enum obj_kind kind);
SHIM_HIDDEN void obj_free(struct obj *o);
SHIM_HIDDEN CUmemGenericAllocationHandle obj_handle(const struct obj *o);
/* Tagged value → live object (refs > 0 required when `need_ref`). */
SHIM_HIDDEN struct obj *obj_lookup(CUmemGenericAllocationHandle h, bool need_ref);
SHIM_HIDDEN struct obj *obj_by_id(const uint8_t id[CUIP_ID_LEN]);
/* Object whose mapping contains `va`, and that mapping's index. */
SHIM_HIDDEN struct obj *obj_by_address(CUdeviceptr va, uint32_t *map_index);
SHIM_HIDDEN uint32_t obj_count(void);
SHIM_HIDDEN struct obj *obj_at(uint32_t i); /* slot i, or NULL if free */
SHIM_HIDDEN int obj_add_mapping(struct obj *o, const struct mapping *m);
SHIM_HIDDEN void obj_del_mapping(struct obj *o, uint32_t i);
/* Under g.lock: note that `participant` (process `pid`) fetched `o`; one
 * entry per participant, its latest pid kept. */
SHIM_HIDDEN int obj_add_fetch(struct obj *o, const char participant[CUIP_PARTICIPANT_LEN],
                              pid_t pid);
/* Free every object (fork child): no driver calls. */
SHIM_HIDDEN void obj_drop_all(void);
/* True when `o` no longer has handles nor mappings: the caller releases it. */
SHIM_HIDDEN bool obj_unused(const struct obj *o);
/* Under g.lock: once `o` is unused, release the shim's driver reference (if
 * live) and free it. */
SHIM_HIDDEN void obj_release_if_unused(struct obj *o);
/* Apply `m`'s recorded access to its freshly mapped range (a map does not
 * restore it); on failure the range is unmapped again, nothing half-done. */
SHIM_HIDDEN CUresult mapping_restore_access(const struct mapping *m, char *msg, size_t n);
/* qsort orders for INSPECT's records: object pointers by resource id,
 * mappings by VA. */
SHIM_HIDDEN int obj_ptr_id_cmp(const void *a, const void *b);
SHIM_HIDDEN int mapping_va_cmp(const void *a, const void *b);
SHIM_HIDDEN bool obj_shared(const struct obj *o);
/* Whether SAVE_ALLOCATIONS moves `o`'s bytes and PREPARE_UNICAST tears it
 * down: an allocation this process created (is_creator) that is shared,
 * or private unless SNAPSHOT_SHIM_STAGE_PRIVATE=0. Never a raw import nor
 * one exportable through another handle type (those refuse the capture).
 * In content mode native nothing is staged, but the predicate still says
 * which allocations are the creator's to keep. */
SHIM_HIDDEN bool obj_staged(const struct obj *o);
/* Under g.lock: a new live object of `kind` for driver handle `h`, held once
 * by the application; NULL on ENOMEM, after releasing `h`. */
SHIM_HIDDEN struct obj *obj_adopt(enum obj_kind kind, CUmemGenericAllocationHandle h);
/* Under g.lock: adopt `h`, just created for the application, as its creator;
 * a handle in the shim's tag range is refused. On failure `h` is released. */
SHIM_HIDDEN CUresult obj_adopt_created(enum obj_kind kind, CUmemGenericAllocationHandle h,
                                       struct obj **out);

/* ---------------------------------------------------------------- io.c */
struct reply {
    struct cuip_header h;
    char msg[CUIP_MESSAGE_MAX];
    struct cuip_record *records;   /* malloc'd, count in h.count */
    int fd;                        /* EXPORT: sent with SCM_RIGHTS, -1 otherwise */
};
SHIM_HIDDEN void reply_init(struct reply *r, uint16_t op);
SHIM_HIDDEN void reply_msg(struct reply *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
SHIM_HIDDEN int reply_send(int s, struct reply *r, uint64_t deadline_ns);
/* Whole buffers before a deadline, or -1 with errno (0: the peer closed). */
SHIM_HIDDEN int io_write_all(int fd, const void *buf, size_t len, uint64_t deadline_ns);
SHIM_HIDDEN int io_read_all(int fd, void *buf, size_t len, uint64_t deadline_ns, int *fd_out);
SHIM_HIDDEN int io_read_fds(int fd, void *buf, size_t len, uint64_t deadline_ns, int *fds,
                            unsigned max, unsigned *n, bool *too_many);

/* ---------------------------------------------------------------- devices.c */
/* A QUIESCE done: note every ordinal's UUID and which ordinals are used. */
SHIM_HIDDEN void devices_remember(void);
/* STATUS with CUIP_ASK_DEVICES: the message lists the GPUs in use, after
 * the driver's path on a line of its own when `with_driver` (CUIP_ASK_ALL). */
SHIM_HIDDEN void devices_report(struct reply *r, bool with_driver);
/* LOAD_ALLOCATIONS: 0 when every used ordinal names the GPU the request's
 * mapping (`len` bytes of `text`; empty: the GPU it had) gives it, else -1
 * with the reply saying which GPU and why; changes nothing. */
SHIM_HIDDEN int devices_check_map(const char *text, size_t len, struct reply *r);

/* ---------------------------------------------------------------- phase work */
/* What the work of a phase op (CUIP_PHASE_OPS) answers the phase machine. */
enum phase_result {
    PHASE_DONE = 0,     /* the op's phase is reached */
    PHASE_FAILED = -1,  /* fail-stop: the shim goes FAILED, the reply says why */
    PHASE_REFUSED = -2, /* refused before doing anything: the phase stays */
    PHASE_PENDING = -4, /* QUIESCE round: not quiet yet, ACTIVE with the gate closed */
    PHASE_RETRY = -3,   /* transient (out of memory), nothing of the failed step kept:
                         * the phase stays, the reply says RETRY */
};
typedef enum phase_result phase_work_fn(struct reply *r);

/* ---------------------------------------------------------------- capability.c */
/* Build a sealed memfd capability for `o`; returns the FD or -1. */
SHIM_HIDDEN int cap_create(const struct obj *o);
enum cap_kind {
    CAP_MALFORMED = -1, /* claims to be a capability, but is not a valid one */
    CAP_NONE = 0,       /* not a capability: a raw FD */
    CAP_VALID = 1,      /* a capability; `cap` is filled */
};
SHIM_HIDDEN enum cap_kind cap_parse(int fd, struct cuip_capability *cap);
/* What an importer knows of a creator's resource: enough to fetch it. */
struct cap_ref {
    uint32_t kind;                         /* enum cuip_resource_kind */
    char creator[CUIP_PARTICIPANT_LEN];
    uint8_t id[CUIP_ID_LEN];
    uint8_t auth[CUIP_AUTH_LEN];
    char endpoint[CUIP_CAP_ENDPOINT_LEN];
    uint64_t size;                         /* what the importer was handed */
};
/* The reference an importer's object `o` holds. */
SHIM_HIDDEN void cap_ref_of(const struct obj *o, struct cap_ref *ref);
/* Ask the creator's endpoint for a fresh raw FD of the resource (EXPORT);
 * -1 and msg on error (refused: nothing recorded), CAP_FETCH_LOST and msg
 * when the reply was lost or unusable after the request went out (the
 * creator may have recorded the fetch), CAP_CREATOR_GONE and msg when nobody
 * serves the endpoint (no socket there, or nobody listening: the creator
 * process is gone). Without g.lock: the creator may be asking us meanwhile. */
#define CAP_CREATOR_GONE (-2)
#define CAP_FETCH_LOST (-4)
SHIM_HIDDEN int cap_fetch(const struct cap_ref *ref, char *msg, size_t n);
/* The one import of a fetched FD: fetch, import, close, and refuse a driver
 * handle in the shim's tag range. 0 and *out; cap_fetch's codes; or
 * CAP_IMPORT_FAILED and *cr. After CAP_IMPORT_FAILED or CAP_FETCH_LOST the
 * creator (may have) recorded the fetch: an application's open then calls
 * cap_withdraw. */
#define CAP_IMPORT_FAILED (-3)
SHIM_HIDDEN int cap_import(const struct cap_ref *ref, CUmemGenericAllocationHandle *out,
                           CUresult *cr, char *msg, size_t n);
/* RESTORE_UNICAST's and the multicast importers' re-import: a fresh export
 * of o's creator imported under o's context (called without g.lock: the
 * creator may be asking us meanwhile). 0 and *out; else -1 (no context) or
 * cap_import's code, and msg. */
SHIM_HIDDEN int cap_import_again(const struct obj *o, CUmemGenericAllocationHandle *out,
                                 char *msg, size_t n);
/* Tell the creator that the open which fetched `ref` failed here, so that
 * no FETCH record names this process (a failure is logged). */
SHIM_HIDDEN void cap_withdraw(const struct cap_ref *ref);
/* Under g.lock: the importer's object for `h`, imported from `ref` (owns h,
 * released on failure: NULL). */
SHIM_HIDDEN struct obj *cap_adopt_import(CUmemGenericAllocationHandle h,
                                         const struct cap_ref *ref, uint64_t handle_types);
/* Serve EXPORT for a peer: `fetcher` (the request's text) in process `pid`
 * (SO_PEERCRED) is recorded as having fetched the allocation. */
SHIM_HIDDEN void cap_serve_export(const struct cuip_header *req,
                                  const char fetcher[CUIP_PARTICIPANT_LEN], pid_t pid,
                                  struct reply *r);
/* Under g.lock, after the INSPECT records: one FETCH record per live
 * fetcher of every allocation INSPECT reported; -1 and a reply message on
 * failure. */
SHIM_HIDDEN int cap_inspect_fetches(struct reply *r);

/* ---------------------------------------------------------------- multicast.c */
/* Under g.lock: how many records multicast_inspect appends, and how many
 * live objects cannot be captured (exportable through another handle type). */
SHIM_HIDDEN uint32_t multicast_record_count(void);
SHIM_HIDDEN uint32_t multicast_unsupported(void);
/* Under g.lock: append the records (room reserved by the caller). */
SHIM_HIDDEN void multicast_inspect(struct reply *r);
/* Called with g.lock held by the application's cuMemMap of a multicast
 * handle (the map waits for the whole team): maps without the lock, records
 * the mapping; returns with g.lock held again. */
SHIM_HIDDEN CUresult multicast_map(struct obj *o, CUdeviceptr ptr, size_t size, size_t offset,
                                   unsigned long long flags);
SHIM_HIDDEN phase_work_fn multicast_prepare;
SHIM_HIDDEN phase_work_fn multicast_restore_creators;
SHIM_HIDDEN phase_work_fn multicast_restore_importers;
SHIM_HIDDEN phase_work_fn multicast_restore_devices;
SHIM_HIDDEN phase_work_fn multicast_restore_bindings;
/* REFUSED (nothing done) while an application bind or multicast map still
 * waits for its team: ROLLBACK_ALLOCATIONS checks it before any work. */
SHIM_HIDDEN phase_work_fn multicast_rollback_ready;
/* ROLLBACK_ALLOCATIONS' multicast part: whatever is still held is torn
 * down, then creators create their objects again. */
SHIM_HIDDEN phase_work_fn multicast_rollback_create;
/* ROLLBACK_IMPORTS' multicast part: import, add devices, bind, map. */
SHIM_HIDDEN phase_work_fn multicast_rollback_rebuild;

/* ---------------------------------------------------------------- unicast.c */
SHIM_HIDDEN int unicast_inspect(struct reply *r);
SHIM_HIDDEN phase_work_fn unicast_prepare;
/* Map every recorded mapping of `o` (o->real) with its access; on failure
 * nothing stays mapped and the failing call's result is returned. */
SHIM_HIDDEN CUresult unicast_load_mappings(struct obj *o, char *msg, size_t n);
/* Unmap every recorded mapping of `o` (all tried; the first error in msg). */
SHIM_HIDDEN int unicast_unload_mappings(struct obj *o, char *msg, size_t n);
/* Not live any more, unmapped, the shim's driver reference released; the
 * reservations stay. */
SHIM_HIDDEN int unicast_drop(struct obj *o, char *msg, size_t n);
SHIM_HIDDEN phase_work_fn unicast_restore;
/* ROLLBACK_IMPORTS' imports: every import dropped (when live) and imported
 * again from its creator. */
SHIM_HIDDEN phase_work_fn unicast_reimport_all;

/* ---------------------------------------------------------------- unowned.c */
/* Sharing the shim cannot rebuild (enum cuip_unowned): recorded by the calls
 * that make it, reported by INSPECT as UNOWNED_SHARING records so that the
 * capture refuses. Each function takes g.lock itself. */
SHIM_HIDDEN void unowned_add(uint16_t kind, uint64_t key, CUdeviceptr address, uint64_t size);
/* One of `kind` with `key` gone (an export's memory freed, an open closed, a
 * pool destroyed: key 0 with kind 0 matches every kind of that key). */
SHIM_HIDDEN void unowned_drop(uint16_t kind, uint64_t key);
/* Under g.lock: how many records unowned_inspect appends; append them
 * (-1 and a reply message on failure). */
SHIM_HIDDEN uint32_t unowned_count(void);
SHIM_HIDDEN int unowned_inspect(struct reply *r);
SHIM_HIDDEN void unowned_after_fork(void);

/* ---------------------------------------------------------------- owned.c */
/* Under g.lock: the owned object whose mapping holds `p`, and the range of it
 * that holds `p` (a live one for the creator, an open one for an importer);
 * NULL when `p` is in no owned range. */
SHIM_HIDDEN struct obj *owned_find(CUdeviceptr p, struct owned_range **range);
/* Give `o` the bookkeeping of an owned object mapped at [base,
 * base+reserved), freed with `o` (obj_free); -1 on ENOMEM. */
SHIM_HIDDEN int owned_new(struct obj *o, CUdeviceptr base, size_t reserved);
/* Under g.lock: unmap, release and forget owned object `o` (a creator's
 * allocation or an importer's import) once nothing holds it. */
SHIM_HIDDEN void owned_release(struct obj *o);
SHIM_HIDDEN struct owned_range *owned_add_range(struct owned *w, uint64_t offset,
                                                uint64_t size);
SHIM_HIDDEN void owned_drop_range(struct owned *w, struct owned_range *range);
/* Reserve `size` bytes of VA and map `h` there with read-write access for
 * the current device (and the devices that enabled peer access to it, when
 * `with_peers`); nothing left on failure. */
SHIM_HIDDEN CUresult owned_map_new(CUmemGenericAllocationHandle h, size_t size, bool with_peers,
                                   CUdeviceptr *va, struct mapping *m);
/* The same with read-write access for the devices in `devices` (bit d:
 * device d), none of them implied. */
SHIM_HIDDEN CUresult owned_map_for(CUmemGenericAllocationHandle h, size_t size, uint64_t devices,
                                   CUdeviceptr *va, struct mapping *m);
/* Under g.lock: the minimum granularity of device `dev` (owned memory's). */
SHIM_HIDDEN CUresult owned_granularity(CUdevice dev, size_t *gran);
/* Unmap [va, va+size) and free its reservation (a driver reference is the
 * caller's); both are tried, the first failure is returned. */
SHIM_HIDDEN CUresult owned_unmap_range(CUdeviceptr va, size_t size);
SHIM_HIDDEN void owned_after_fork(void);
/* What a gated call's hook answers when the call is not the shim's business. */
#define SHIM_NOT_MINE ((CUresult)0x7fff0001)
/* cuMemFreeAsync of owned memory (its stream waited for, then freed), or
 * SHIM_NOT_MINE. */
SHIM_HIDDEN CUresult CUDAAPI owned_free_async(CUdeviceptr dptr, CUstream stream);

/* ---------------------------------------------------------------- staging.c */
/* Where a phase's staging time went (nanoseconds). The *_ns of a step are
 * summed over the pool's threads; copy_wall_ns is the wall time during which
 * at least one copy was in flight. */
/* How an op faulted fresh staging memory in before copying into it. */
enum staging_populate {
    STAGING_POPULATE_NONE = 0,  /* it did not: the memcpy out of the bounce buffer does */
    STAGING_POPULATE_MADVISE,   /* MADV_POPULATE_WRITE */
    STAGING_POPULATE_TOUCH,     /* the kernel lacks it: one byte written per page */
};
struct staging_times {
    uint64_t pool_start_ns, populate_ns, register_ns, copy_ns, copy_wall_ns, unregister_ns,
        release_ns, memcpy_ns, chunks;
    uint64_t stream_ns;         /* workers' streams and events, made and destroyed */
    uint64_t populated_chunks;  /* by the populate-ahead threads */
    unsigned threads;           /* workers started (none: the control thread works) */
    size_t chunk;               /* bytes per chunk, at most */
    unsigned spread;            /* chunks per thread the chunk was cut for */
    enum staging_populate populate_how;
};
struct staging;
/* Host memory for staged copies: one anonymous mapping of `len` bytes,
 * 2 MiB aligned, advised MADV_HUGEPAGE unless SNAPSHOT_SHIM_STAGING_THP=0;
 * NULL and msg on failure. Slices of it are unmapped by their owners. */
SHIM_HIDDEN void *staging_alloc(size_t len, char *msg, size_t n);
/* Free the bounce buffers (SNAPSHOT_SHIM_STAGING_BOUNCE_KEEP=0, after a
 * LOAD), `ctx` current: nothing pinned while the application runs, and the
 * next SAVE pins them again. */
SHIM_HIDDEN void staging_free_bounces(CUcontext ctx);
/* `ctx` is gone (destroyed or reset): forget the bounce buffers pinned in it
 * and the workers' streams and events made in it, which went with it. No
 * driver call. */
SHIM_HIDDEN void staging_forget_ctx(CUcontext ctx);
/* Bytes of staging memory one allocation of `size` bytes takes. */
SHIM_HIDDEN size_t staging_len(size_t size);
/* Start the pool for a phase moving `total` bytes of at most `items`
 * allocations, device to host when `to_host` (into fresh memory that the
 * workers populate first unless `populated`); NULL and msg on failure. */
SHIM_HIDDEN struct staging *staging_start(bool to_host, bool populated, uint64_t total,
                                          uint32_t items, char *msg, size_t n);
/* Queue the copy of all of `o` between `host` and `dev` (o->size bytes) in
 * context `ctx`; it may start at once. Never blocks. */
SHIM_HIDDEN int staging_add(struct staging *s, const struct obj *o, char *host, CUdeviceptr dev,
                            CUcontext ctx);
/* The same for `len` bytes of `o` from `offset` on (`host` and `dev` are
 * where they lie); `direct`: `host` is pinned for good (a kept host copy),
 * copied straight, no bounce buffer. */
SHIM_HIDDEN int staging_add_range(struct staging *s, const struct obj *o, char *host,
                                  CUdeviceptr dev, CUcontext ctx, size_t offset, size_t len,
                                  bool direct);
/* Queue giving the pages of [host, host+len) back (after the copies). */
SHIM_HIDDEN int staging_release(struct staging *s, char *host, size_t len);
/* Wait until everything queued is done; -1 and the
 * first error's message if anything failed. The pool stays for more. */
SHIM_HIDDEN int staging_wait(struct staging *s, char *msg, size_t n);
/* Join the pool and free it; its figures in `t` (may be NULL). */
SHIM_HIDDEN void staging_stop(struct staging *s, struct staging_times *t);

/* ---------------------------------------------------------------- keep.c */
/* The kept host copy of one allocation (SNAPSHOT_SHIM_KEEP_HOST_COPY). */
struct keep_copy {
    uint8_t id[CUIP_ID_LEN];      /* the allocation's */
    uint64_t size;
    size_t len;                   /* pinned bytes at `host` (staging_len(size)) */
    char *host;                   /* NULL: not pinned (`why`) */
    CUcontext ctx;                /* where it was pinned: the allocation's */
    pid_t pid;
    bool registered;              /* our mapping, registered; else cuMemHostAlloc'd */
    bool tried;                   /* the keeper tried to pin it (it does not try again) */
    bool seen;                    /* keep.c's reconcile */
    /* `hash` (two words a KH_CHUNK) is the hash of what `host` holds, and
     * `host` holds all of the allocation's bytes as of the last SAVE or LOAD */
    bool valid;
    uint64_t *hash;
    char why[200];                /* why it is not pinned */
};
/* One allocation for keep_hash: its copy, a device VA mapping all of it in
 * context `ctx`; `fresh`, malloc'd by keep_hash: the device bytes' hashes. */
struct keep_item {
    struct keep_copy *c;
    CUdeviceptr va;
    CUcontext ctx;
    uint64_t *fresh;
};
SHIM_HIDDEN bool keep_enabled(void);
/* The keeper thread (lifecycle.c's start, when the setting is on). */
SHIM_HIDDEN void keep_start(void);
/* In a fork child: no keeper, and the table's lock free. */
SHIM_HIDDEN void keep_after_fork(void);
/* An op's hold of the table: every allocation SAVE moves has an entry, pinned
 * unless its pin failed (`why`); -1 when the mode is off (no hold). */
SHIM_HIDDEN int keep_begin(void);
SHIM_HIDDEN void keep_end(void);
/* Between keep_begin and keep_end: the copy of `o`, NULL if none. */
SHIM_HIDDEN struct keep_copy *keep_of(const struct obj *o);
/* Every kept copy freed (STORE_STAGED: the bytes are in the files, and a
 * CRIU image must not hold them); the keeper pins them again after a LOAD. */
SHIM_HIDDEN void keep_give_back(void);
/* HOST_COPY (control.c, ACTIVE, no op in flight): the mode on (the keeper
 * started, everything pinned at its next look) or off (every copy freed). */
SHIM_HIDDEN void keep_request(bool keep);
/* A context destroyed took its cuMemHostAlloc'd copies and its module along. */
SHIM_HIDDEN void keep_forget_ctx(CUcontext ctx);
/* Pinned bytes, copies, and the hash tables' bytes (for STATUS). */
SHIM_HIDDEN void keep_status(uint64_t *bytes, uint64_t *count, uint64_t *overhead);
/* The device bytes of `items` hashed on the GPU: 0, or -1 and `why` (then no
 * `fresh`). */
SHIM_HIDDEN int keep_hash(struct keep_item *items, uint32_t n, char *why, size_t wn);
/* Whether chunk `chunk` of the copy holds what `fresh` says the device does. */
SHIM_HIDDEN bool keep_chunk_same(const struct keep_copy *c, const uint64_t *fresh,
                                 uint64_t chunk);
/* After a SAVE: `fresh` becomes the copy's hash when `ok` (else freed, and the
 * copy no longer trusted). */
SHIM_HIDDEN void keep_settle(struct keep_copy *c, uint64_t *fresh, bool ok);
struct reply;
/* One HOST_COPY record appended to the reply (protocol.h); -1 out of memory. */
SHIM_HIDDEN int keep_record(struct reply *r, uint64_t copied, uint64_t unchanged,
                            uint32_t hash);

/* ---------------------------------------------------------------- content.c */
SHIM_HIDDEN phase_work_fn content_save;
SHIM_HIDDEN phase_work_fn content_load;
/* ROLLBACK_ALLOCATIONS' content: LOAD keeping the staged bytes; refused when
 * a torn-down allocation has none. */
SHIM_HIDDEN phase_work_fn content_reload;
/* Free every staged host copy. */
SHIM_HIDDEN void content_free_staged(void);
/* Unmap the resident staging mapping (SNAPSHOT_SHIM_STAGING_RESIDENT_MIB)
 * when no staged copy lies in it: its pages must not reach a process image. */
SHIM_HIDDEN void content_drop_resident(void);
/* Wait until the staged copies the last LOAD gave up are freed (a thread of
 * its own frees them after the reply): called before anything allocates or
 * reads staging memory. */
SHIM_HIDDEN void content_settle(void);
/* At exit: content_settle unless an op is in flight. */
SHIM_HIDDEN void content_exit(void);

/* ---------------------------------------------------------------- stored.c */
/* The descriptors a request handed (STORE_STAGED / FETCH_STAGED only). */
struct request_fds {
    int fd[CUIP_STORED_MAX_PARTS];
    unsigned n;
    bool too_many; /* more than CUIP_STORED_MAX_PARTS came: all closed */
};
/* STORE_STAGED / FETCH_STAGED with the request's descriptors, part k the
 * k-th: the staged copies to and from the coordinator's files. */
SHIM_HIDDEN void stored_serve(const struct cuip_header *q, const struct request_fds *fds,
                              struct reply *r);

/* ---------------------------------------------------------------- quiesce.c */
/* QUIESCE: the gate closed in two steps until every context of this process
 * is idle, within SNAPSHOT_SHIM_QUIESCE_TIMEOUT_S; refused (gate reopened)
 * otherwise, naming what the threads were held at. */
SHIM_HIDDEN phase_work_fn quiesce_run;
/* The contexts the application's work can be queued in: those of the shim's
 * objects and every active primary context (the runtime's, retained while
 * in the set). As many as there are. */
struct ctx_set {
    CUcontext *ctx;
    int *primary_of;                 /* the retained primary context's device; -1 */
    uint32_t n, cap;
};
/* 0, or -1 and msg (out of memory: nothing held). */
SHIM_HIDDEN int ctx_set_collect(struct ctx_set *s, char *msg, size_t n);
/* cuCtxSynchronize of each in turn (blocks; no lock held): the first
 * failure, its index in *failed and the call that failed in *call. */
SHIM_HIDDEN CUresult ctx_set_sync(const struct ctx_set *s, uint32_t *failed, const char **call);
/* Release the retained primary contexts, free the set. */
SHIM_HIDDEN void ctx_set_free(struct ctx_set *s);

/* ---------------------------------------------------------------- rollback.c */
SHIM_HIDDEN phase_work_fn rollback_allocations;
SHIM_HIDDEN phase_work_fn rollback_imports;

/* ---------------------------------------------------------------- control.c */
/* How often, at least, the listener thread checks that its published path
 * still leads to it (lifecycle.c heals it otherwise). */
#define CONTROL_HEAL_MS 100
/* The listener thread: accepts on the socket `arg` (an int) for ever. */
SHIM_HIDDEN void *control_listen(void *arg);
/* `heal(fd)` is called by the listener thread at least every
 * CONTROL_HEAL_MS and returns the socket to accept on from then on: `fd`,
 * or a new one, in which case the listener serves what is queued on `fd`
 * and closes it. Set before the thread starts. */
SHIM_HIDDEN void control_set_heal(int (*heal)(int fd));
/* Fork child: no connection of the parent's is ours. */
SHIM_HIDDEN void control_after_fork(void);

#endif
