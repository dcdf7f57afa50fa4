/*
 * Interception: every way a program reaches the driver ends in the shim.
 *
 *  - direct symbols: the shim is preloaded, so its cuMemCreate & co. win;
 *  - dlsym (RTLD_DEFAULT/RTLD_NEXT or an explicit dlopen handle of libcuda or
 *    libcudart): the shim defines dlsym and substitutes its own wrapper for
 *    a tracked name, but only after the real dlsym found the symbol;
 *  - cuGetProcAddress / _v2 / _v2_ptsz and cudaGetDriverEntryPoint /
 *    ByVersion / _ptsz: the real resolver runs first; its answer is replaced
 *    only when it succeeded with a non-null pointer, by the wrapper of the
 *    same ABI. The ABI is taken from the pointer the driver returned when it
 *    is one of the driver's exports (exact), else from the requested version.
 *
 * Besides the tracked calls, every call that launches device work or waits
 * for it on the host is gated (gate.c; the list is GATED_CALLS below and in
 * specs/quiesce.md). A gated call has slots: slot 0 is the shim's export of
 * the driver's symbol, the others are handed out by the resolvers, one per
 * distinct pointer the driver answered (the default-stream and per-thread
 * variants, internal entry points), so each wrapper calls exactly what the
 * driver would have given the application. Its per-thread default stream
 * export (_ptsz, _ptds), where cuda.h has one, is gated as well and calls
 * the driver's symbol of that name.
 *
 * The real driver is never linked: driver.c opens it by soname at first use.
 */
#include "shim.h"

#include <dlfcn.h>
#include <string.h>

SHIM_NO_SAN static bool same(const char *a, const char *b)
{
    while (*a && *a == *b) {
        a++;
        b++;
    }
    return *a == *b;
}

/* ------------------------------------------------------------ wrappers */
/* Defined in this file, unicast.c, multicast.c and capability.c. cuda.h maps some
 * names to _v2 with macros; the old ABIs are declared here by hand. */
#undef cuGetProcAddress
/* cuda.h maps the batch copies' names to their 13.0 ABI (_v2); the names
 * themselves are the 12.8 ABI, exported by the driver as such. */
#undef cuMemcpyBatchAsync
#undef cuMemcpy3DBatchAsync
/* The same for the stream memory operations: the names are CUDA 8.0's ABI,
 * which has the same signature as 11.7's _v2. */
#undef cuStreamWaitValue32
#undef cuStreamWaitValue64
#undef cuStreamWriteValue32
#undef cuStreamWriteValue64
#undef cuStreamBatchMemOp
/* CUDA 4.1's cuIpcOpenMemHandle has the ABI of 11.0's _v2 (ipc.c). */
#undef cuIpcOpenMemHandle
SHIM_EXPORT CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                                unsigned int Flags);
SHIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags);
SHIM_EXPORT CUresult cuGetProcAddress_v2_ptsz(const char *symbol, void **pfn, int cudaVersion,
                                              cuuint64_t flags,
                                              CUdriverProcAddressQueryResult *status);

/* The runtime's entry points; ints stand for cudaError_t and the query enum
 * so that no runtime header is needed. */
typedef int (*rt_entry_fn)(const char *, void **, unsigned long long, int *);
typedef int (*rt_entry_ver_fn)(const char *, void **, unsigned int, unsigned long long, int *);
SHIM_EXPORT int cudaGetDriverEntryPoint(const char *, void **, unsigned long long, int *);
SHIM_EXPORT int cudaGetDriverEntryPoint_ptsz(const char *, void **, unsigned long long, int *);
SHIM_EXPORT int cudaGetDriverEntryPointByVersion(const char *, void **, unsigned int,
                                                 unsigned long long, int *);
SHIM_EXPORT int cudaGetDriverEntryPointByVersion_ptsz(const char *, void **, unsigned int,
                                                      unsigned long long, int *);
SHIM_EXPORT void *dlsym(void *handle, const char *name);

/* One tracked driver function. `v2` is the newer ABI (NULL when it has
 * one), used from `split` on; real_v1/real_v2 point into `real`. */
struct tracked {
    const char *base;
    void *v1;
    void *v2;
    int split;
    void **real_v1;
    void **real_v2;
};

#define T1(name) {#name, (void *)name, NULL, 0, (void **)&real.name, NULL}
/* A name whose first ABI the shim does not wrap (CUDA 2.x's 32-bit device
 * pointers): its _v2, from `split` on. */
static void *const no_v1 = NULL;
#define T2(name, v2, split) {#name, NULL, (void *)v2, split, (void **)&no_v1, (void **)&real.v2}
static const struct tracked tracked[] = {
    {"cuGetProcAddress", (void *)cuGetProcAddress, (void *)cuGetProcAddress_v2, 12000,
     (void **)&real.gpa_v1, (void **)&real.cuGetProcAddress_v2},
    T1(cuInit),
    T1(cuMemCreate),
    T1(cuMemRelease),
    T1(cuMemMap),
    T1(cuMemUnmap),
    T1(cuMemAddressFree),
    T1(cuMemSetAccess),
    T1(cuMemRetainAllocationHandle),
    T1(cuMemGetAllocationPropertiesFromHandle),
    T1(cuMemExportToShareableHandle),
    T1(cuMemImportFromShareableHandle),
    T1(cuMulticastCreate),
    T1(cuMulticastAddDevice),
    {"cuMulticastBindMem", (void *)cuMulticastBindMem, (void *)cuMulticastBindMem_v2, 13010,
     (void **)&real.cuMulticastBindMem, (void **)&real.cuMulticastBindMem_v2},
    {"cuMulticastBindAddr", (void *)cuMulticastBindAddr, (void *)cuMulticastBindAddr_v2, 13010,
     (void **)&real.cuMulticastBindAddr, (void **)&real.cuMulticastBindAddr_v2},
    T1(cuMulticastUnbind),
    T2(cuMemAlloc, cuMemAlloc_v2, 3020),
    T2(cuMemAllocPitch, cuMemAllocPitch_v2, 3020),
    T2(cuMemFree, cuMemFree_v2, 3020),
    T2(cuMemGetAddressRange, cuMemGetAddressRange_v2, 3020),
    T2(cuCtxDestroy, cuCtxDestroy_v2, 4000),
    T2(cuDevicePrimaryCtxReset, cuDevicePrimaryCtxReset_v2, 11000),
    T2(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, 11000),
    T1(cuPointerGetAttribute),
    T1(cuPointerGetAttributes),
    T1(cuCtxEnablePeerAccess),
    T1(cuCtxDisablePeerAccess),
    T1(cuIpcGetMemHandle),
    {"cuIpcOpenMemHandle", (void *)cuIpcOpenMemHandle, (void *)cuIpcOpenMemHandle_v2, 11000,
     (void **)&real.cuIpcOpenMemHandle_v1, (void **)&real.cuIpcOpenMemHandle_v2},
    T1(cuIpcCloseMemHandle),
    T1(cuMemPoolExportToShareableHandle),
    T1(cuMemPoolImportFromShareableHandle),
    T1(cuMemPoolExportPointer),
    T1(cuMemPoolImportPointer),
    T1(cuMemPoolDestroy),
};
#define NTRACKED (sizeof tracked / sizeof tracked[0])

/* ------------------------------------------------------------ gated calls */
#define GATE_SLOTS 8
#define NO_MAX 0x7fffffff

/* X(symbol, resolver name, first version, last version + 1, class, per-thread
 * variant, params, args). The per-thread variant is the suffix of the
 * driver's export for the per-thread default stream (cuda.h's
 * CUDA_API_PER_THREAD_DEFAULT_STREAM list: symbol_ptsz, symbol_ptds) or none.
 * Launching: queues device work (copies, memsets, value waits and writes,
 * stream-ordered allocation, event records and waits). Synchronizing: blocks
 * the host until device work is done (synchronizes, blocking copies). */
#define GATED_CALLS(X)                                                                         \
    X(cuLaunchKernel, "cuLaunchKernel", 0, NO_MAX, GATE_LAUNCH, ptsz,                          \
      (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,       \
      unsigned int by, unsigned int bz, unsigned int shm, CUstream s, void **p, void **e),     \
      (f, gx, gy, gz, bx, by, bz, shm, s, p, e))                                               \
    X(cuLaunchKernelEx, "cuLaunchKernelEx", 0, NO_MAX, GATE_LAUNCH, ptsz,                      \
      (const CUlaunchConfig *c, CUfunction f, void **p, void **e), (c, f, p, e))               \
    X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 0, NO_MAX, GATE_LAUNCH, ptsz,    \
      (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,       \
      unsigned int by, unsigned int bz, unsigned int shm, CUstream s, void **p), (f, gx, gy,   \
      gz, bx, by, bz, shm, s, p))                                                              \
    X(cuLaunchHostFunc, "cuLaunchHostFunc", 0, NO_MAX, GATE_LAUNCH, ptsz,                      \
      (CUstream s, CUhostFn fn, void *arg), (s, fn, arg))                                      \
    X(cuGraphLaunch, "cuGraphLaunch", 0, NO_MAX, GATE_LAUNCH, ptsz,                            \
      (CUgraphExec g, CUstream s), (g, s))                                                     \
    X(cuEventRecord, "cuEventRecord", 0, NO_MAX, GATE_LAUNCH, ptsz,                            \
      (CUevent ev, CUstream s), (ev, s))                                                       \
    X(cuEventRecordWithFlags, "cuEventRecordWithFlags", 0, NO_MAX, GATE_LAUNCH, ptsz,          \
      (CUevent ev, CUstream s, unsigned int fl), (ev, s, fl))                                  \
    X(cuStreamAddCallback, "cuStreamAddCallback", 0, NO_MAX, GATE_LAUNCH, ptsz,                \
      (CUstream s, CUstreamCallback cb, void *arg, unsigned int fl), (s, cb, arg, fl))         \
    X(cuStreamWaitEvent, "cuStreamWaitEvent", 0, NO_MAX, GATE_LAUNCH, ptsz,                    \
      (CUstream s, CUevent ev, unsigned int fl), (s, ev, fl))                                  \
    X(cuMemcpyAsync, "cuMemcpyAsync", 0, NO_MAX, GATE_LAUNCH, ptsz,                            \
      (CUdeviceptr d, CUdeviceptr src, size_t n, CUstream s), (d, src, n, s))                  \
    X(cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync", 3020, NO_MAX, GATE_LAUNCH, ptsz,              \
      (CUdeviceptr d, const void *src, size_t n, CUstream s), (d, src, n, s))                  \
    X(cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync", 3020, NO_MAX, GATE_LAUNCH, ptsz,              \
      (void *d, CUdeviceptr src, size_t n, CUstream s), (d, src, n, s))                        \
    X(cuMemcpyDtoDAsync_v2, "cuMemcpyDtoDAsync", 3020, NO_MAX, GATE_LAUNCH, ptsz,              \
      (CUdeviceptr d, CUdeviceptr src, size_t n, CUstream s), (d, src, n, s))                  \
    X(cuMemcpy2DAsync_v2, "cuMemcpy2DAsync", 3020, NO_MAX, GATE_LAUNCH, ptsz,                  \
      (const CUDA_MEMCPY2D *c, CUstream s), (c, s))                                            \
    X(cuMemcpy3DAsync_v2, "cuMemcpy3DAsync", 3020, NO_MAX, GATE_LAUNCH, ptsz,                  \
      (const CUDA_MEMCPY3D *c, CUstream s), (c, s))                                            \
    X(cuMemcpyPeerAsync, "cuMemcpyPeerAsync", 0, NO_MAX, GATE_LAUNCH, ptsz,                    \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n, CUstream s),      \
      (d, dc, src, sc, n, s))                                                                  \
    X(cuMemcpy3DPeerAsync, "cuMemcpy3DPeerAsync", 0, NO_MAX, GATE_LAUNCH, ptsz,                \
      (const CUDA_MEMCPY3D_PEER *c, CUstream s), (c, s))                                       \
    X(cuMemcpyHtoAAsync_v2, "cuMemcpyHtoAAsync", 3020, NO_MAX, GATE_LAUNCH, ptsz,              \
      (CUarray a, size_t off, const void *src, size_t n, CUstream s), (a, off, src, n, s))     \
    X(cuMemcpyAtoHAsync_v2, "cuMemcpyAtoHAsync", 3020, NO_MAX, GATE_LAUNCH, ptsz,              \
      (void *d, CUarray a, size_t off, size_t n, CUstream s), (d, a, off, n, s))               \
    X(cuMemcpyBatchAsync, "cuMemcpyBatchAsync", 0, 13000, GATE_LAUNCH, ptsz,                   \
      (CUdeviceptr *d, CUdeviceptr *src, size_t *n, size_t count, CUmemcpyAttributes *a,       \
      size_t *ai, size_t na, size_t *fail, CUstream s), (d, src, n, count, a, ai, na, fail,    \
      s))                                                                                      \
    X(cuMemcpyBatchAsync_v2, "cuMemcpyBatchAsync", 13000, NO_MAX, GATE_LAUNCH, ptsz,           \
      (CUdeviceptr *d, CUdeviceptr *src, size_t *n, size_t count, CUmemcpyAttributes *a,       \
      size_t *ai, size_t na, CUstream s), (d, src, n, count, a, ai, na, s))                    \
    X(cuMemcpy3DBatchAsync, "cuMemcpy3DBatchAsync", 0, 13000, GATE_LAUNCH, ptsz,               \
      (size_t n, CUDA_MEMCPY3D_BATCH_OP *ops, size_t *fail, unsigned long long fl, CUstream    \
      s), (n, ops, fail, fl, s))                                                               \
    X(cuMemcpy3DBatchAsync_v2, "cuMemcpy3DBatchAsync", 13000, NO_MAX, GATE_LAUNCH, ptsz,       \
      (size_t n, CUDA_MEMCPY3D_BATCH_OP *ops, unsigned long long fl, CUstream s), (n, ops,     \
      fl, s))                                                                                  \
    X(cuMemsetD8Async, "cuMemsetD8Async", 0, NO_MAX, GATE_LAUNCH, ptsz,                        \
      (CUdeviceptr d, unsigned char v, size_t n, CUstream s), (d, v, n, s))                    \
    X(cuMemsetD16Async, "cuMemsetD16Async", 0, NO_MAX, GATE_LAUNCH, ptsz,                      \
      (CUdeviceptr d, unsigned short v, size_t n, CUstream s), (d, v, n, s))                   \
    X(cuMemsetD32Async, "cuMemsetD32Async", 0, NO_MAX, GATE_LAUNCH, ptsz,                      \
      (CUdeviceptr d, unsigned int v, size_t n, CUstream s), (d, v, n, s))                     \
    X(cuMemsetD8_v2, "cuMemsetD8", 3020, NO_MAX, GATE_LAUNCH, ptds,                            \
      (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))                                   \
    X(cuMemsetD16_v2, "cuMemsetD16", 3020, NO_MAX, GATE_LAUNCH, ptds,                          \
      (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))                                  \
    X(cuMemsetD32_v2, "cuMemsetD32", 3020, NO_MAX, GATE_LAUNCH, ptds,                          \
      (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))                                    \
    X(cuMemsetD2D8_v2, "cuMemsetD2D8", 3020, NO_MAX, GATE_LAUNCH, ptds,                        \
      (CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h), (d, pitch, v, w, h)) \
    X(cuMemsetD2D16_v2, "cuMemsetD2D16", 3020, NO_MAX, GATE_LAUNCH, ptds,                      \
      (CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h), (d, pitch, v, w, h)) \
    X(cuMemsetD2D32_v2, "cuMemsetD2D32", 3020, NO_MAX, GATE_LAUNCH, ptds,                      \
      (CUdeviceptr d, size_t pitch, unsigned int v, size_t w, size_t h), (d, pitch, v, w, h))  \
    X(cuMemsetD2D8Async, "cuMemsetD2D8Async", 3020, NO_MAX, GATE_LAUNCH, ptsz,                 \
      (CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h, CUstream s),          \
      (d, pitch, v, w, h, s))                                                                  \
    X(cuMemsetD2D16Async, "cuMemsetD2D16Async", 3020, NO_MAX, GATE_LAUNCH, ptsz,               \
      (CUdeviceptr d, size_t pitch, unsigned short v, size_t w, size_t h, CUstream s),         \
      (d, pitch, v, w, h, s))                                                                  \
    X(cuMemsetD2D32Async, "cuMemsetD2D32Async", 3020, NO_MAX, GATE_LAUNCH, ptsz,               \
      (CUdeviceptr d, size_t pitch, unsigned int v, size_t w, size_t h, CUstream s),           \
      (d, pitch, v, w, h, s))                                                                  \
    X(cuMemAllocAsync, "cuMemAllocAsync", 0, NO_MAX, GATE_LAUNCH, ptsz,                        \
      (CUdeviceptr *d, size_t n, CUstream s), (d, n, s))                                       \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 0, NO_MAX, GATE_LAUNCH, ptsz,        \
      (CUdeviceptr *d, size_t n, CUmemoryPool pool, CUstream s), (d, n, pool, s))              \
    X(cuMemFreeAsync, "cuMemFreeAsync", 0, NO_MAX, GATE_LAUNCH, ptsz,                          \
      (CUdeviceptr d, CUstream s), (d, s))                                                     \
    X(cuStreamWaitValue32, "cuStreamWaitValue32", 0, 11070, GATE_LAUNCH, ptsz,                 \
      (CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int fl), (s, a, v, fl))               \
    X(cuStreamWaitValue32_v2, "cuStreamWaitValue32", 11070, NO_MAX, GATE_LAUNCH, ptsz,         \
      (CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int fl), (s, a, v, fl))               \
    X(cuStreamWaitValue64, "cuStreamWaitValue64", 0, 11070, GATE_LAUNCH, ptsz,                 \
      (CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int fl), (s, a, v, fl))               \
    X(cuStreamWaitValue64_v2, "cuStreamWaitValue64", 11070, NO_MAX, GATE_LAUNCH, ptsz,         \
      (CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int fl), (s, a, v, fl))               \
    X(cuStreamWriteValue32, "cuStreamWriteValue32", 0, 11070, GATE_LAUNCH, ptsz,               \
      (CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int fl), (s, a, v, fl))               \
    X(cuStreamWriteValue32_v2, "cuStreamWriteValue32", 11070, NO_MAX, GATE_LAUNCH, ptsz,       \
      (CUstream s, CUdeviceptr a, cuuint32_t v, unsigned int fl), (s, a, v, fl))               \
    X(cuStreamWriteValue64, "cuStreamWriteValue64", 0, 11070, GATE_LAUNCH, ptsz,               \
      (CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int fl), (s, a, v, fl))               \
    X(cuStreamWriteValue64_v2, "cuStreamWriteValue64", 11070, NO_MAX, GATE_LAUNCH, ptsz,       \
      (CUstream s, CUdeviceptr a, cuuint64_t v, unsigned int fl), (s, a, v, fl))               \
    X(cuStreamBatchMemOp, "cuStreamBatchMemOp", 0, 11070, GATE_LAUNCH, ptsz,                   \
      (CUstream s, unsigned int n, CUstreamBatchMemOpParams *ops, unsigned int fl), (s, n,     \
      ops, fl))                                                                                \
    X(cuStreamBatchMemOp_v2, "cuStreamBatchMemOp", 11070, NO_MAX, GATE_LAUNCH, ptsz,           \
      (CUstream s, unsigned int n, CUstreamBatchMemOpParams *ops, unsigned int fl), (s, n,     \
      ops, fl))                                                                                \
    X(cuCtxSynchronize, "cuCtxSynchronize", 0, 13000, GATE_SYNC, none, (void), ())             \
    X(cuCtxSynchronize_v2, "cuCtxSynchronize", 13000, NO_MAX, GATE_SYNC, none,                 \
      (CUcontext c), (c))                                                                      \
    X(cuStreamSynchronize, "cuStreamSynchronize", 0, NO_MAX, GATE_SYNC, ptsz,                  \
      (CUstream s), (s))                                                                       \
    X(cuEventSynchronize, "cuEventSynchronize", 0, NO_MAX, GATE_SYNC, none,                    \
      (CUevent ev), (ev))                                                                      \
    X(cuMemcpy, "cuMemcpy", 0, NO_MAX, GATE_SYNC, ptds,                                        \
      (CUdeviceptr d, CUdeviceptr src, size_t n), (d, src, n))                                 \
    X(cuMemcpyHtoD_v2, "cuMemcpyHtoD", 3020, NO_MAX, GATE_SYNC, ptds,                          \
      (CUdeviceptr d, const void *src, size_t n), (d, src, n))                                 \
    X(cuMemcpyDtoH_v2, "cuMemcpyDtoH", 3020, NO_MAX, GATE_SYNC, ptds,                          \
      (void *d, CUdeviceptr src, size_t n), (d, src, n))                                       \
    X(cuMemcpyDtoD_v2, "cuMemcpyDtoD", 3020, NO_MAX, GATE_SYNC, ptds,                          \
      (CUdeviceptr d, CUdeviceptr src, size_t n), (d, src, n))                                 \
    X(cuMemcpy2D_v2, "cuMemcpy2D", 3020, NO_MAX, GATE_SYNC, ptds,                              \
      (const CUDA_MEMCPY2D *c), (c))                                                           \
    X(cuMemcpy2DUnaligned_v2, "cuMemcpy2DUnaligned", 3020, NO_MAX, GATE_SYNC, ptds,            \
      (const CUDA_MEMCPY2D *c), (c))                                                           \
    X(cuMemcpy3D_v2, "cuMemcpy3D", 3020, NO_MAX, GATE_SYNC, ptds,                              \
      (const CUDA_MEMCPY3D *c), (c))                                                           \
    X(cuMemcpyPeer, "cuMemcpyPeer", 0, NO_MAX, GATE_SYNC, ptds,                                \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n), (d, dc, src,     \
      sc, n))                                                                                  \
    X(cuMemcpy3DPeer, "cuMemcpy3DPeer", 0, NO_MAX, GATE_SYNC, ptds,                            \
      (const CUDA_MEMCPY3D_PEER *c), (c))                                                      \
    X(cuMemcpyAtoH_v2, "cuMemcpyAtoH", 3020, NO_MAX, GATE_SYNC, ptds,                          \
      (void *d, CUarray a, size_t off, size_t n), (d, a, off, n))                              \
    X(cuMemcpyHtoA_v2, "cuMemcpyHtoA", 3020, NO_MAX, GATE_SYNC, ptds,                          \
      (CUarray a, size_t off, const void *src, size_t n), (a, off, src, n))                    \
    X(cuMemcpyAtoD_v2, "cuMemcpyAtoD", 3020, NO_MAX, GATE_SYNC, ptds,                          \
      (CUdeviceptr d, CUarray a, size_t off, size_t n), (d, a, off, n))                        \
    X(cuMemcpyDtoA_v2, "cuMemcpyDtoA", 3020, NO_MAX, GATE_SYNC, ptds,                          \
      (CUarray a, size_t off, CUdeviceptr src, size_t n), (a, off, src, n))                    \
    X(cuMemcpyAtoA_v2, "cuMemcpyAtoA", 3020, NO_MAX, GATE_SYNC, ptds,                          \
      (CUarray d, size_t doff, CUarray a, size_t off, size_t n), (d, doff, a, off, n))

/* The driver's own export, found once (slot 0). */
static void *direct(void **slot, const char *symbol)
{
    void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!p) {
        p = shim_driver_symbol(symbol);
        if (p)
            __atomic_store_n(slot, p, __ATOMIC_RELEASE);
    }
    return p;
}

#define GATED_VIA(sym, base, cls, params, args, k)                                        \
    static CUresult CUDAAPI sym##_via##k params                                           \
    {                                                                                     \
        sym##_fn f_ = (sym##_fn)__atomic_load_n(&sym##_slot[k], __ATOMIC_ACQUIRE);        \
        CUresult r_;                                                                      \
        if (sym##_hook && (r_ = sym##_hook args) != SHIM_NOT_MINE)                        \
            return r_;                                                                    \
        gate_enter(cls, base);                                                            \
        r_ = f_ args;                                                                     \
        gate_leave(cls);                                                                  \
        return r_;                                                                        \
    }

/* The shim's export `name`: the driver's own export of that name, found once
 * in *slot, called through the gate as `call`. */
#define GATED_EXPORT(name, fn, slot, call, cls, hook, params, args)                       \
    SHIM_EXPORT CUresult CUDAAPI name params                                              \
    {                                                                                     \
        fn f_ = (fn)direct(slot, #name);                                                  \
        CUresult r_;                                                                      \
        if (hook && (r_ = hook args) != SHIM_NOT_MINE)                                    \
            return r_;                                                                    \
        if (!f_)                                                                          \
            return CUDA_ERROR_NOT_INITIALIZED;                                            \
        gate_enter(cls, call);                                                            \
        r_ = f_ args;                                                                     \
        gate_leave(cls);                                                                  \
        return r_;                                                                        \
    }

#define GATED_DEFINE(sym, base, from, until, cls, pt, params, args)                       \
    typedef CUresult(CUDAAPI *sym##_fn) params;                                           \
    static void *sym##_slot[GATE_SLOTS];                                                  \
    static sym##_fn sym##_hook;                                                           \
    GATED_VIA(sym, base, cls, params, args, 1)                                            \
    GATED_VIA(sym, base, cls, params, args, 2)                                            \
    GATED_VIA(sym, base, cls, params, args, 3)                                            \
    GATED_VIA(sym, base, cls, params, args, 4)                                            \
    GATED_VIA(sym, base, cls, params, args, 5)                                            \
    GATED_VIA(sym, base, cls, params, args, 6)                                            \
    GATED_VIA(sym, base, cls, params, args, 7)                                            \
    GATED_EXPORT(sym, sym##_fn, &sym##_slot[0], base, cls, sym##_hook, params, args)      \
    static void *const sym##_vias[GATE_SLOTS] = {                                         \
        (void *)sym,         (void *)sym##_via1, (void *)sym##_via2, (void *)sym##_via3,  \
        (void *)sym##_via4,  (void *)sym##_via5, (void *)sym##_via6, (void *)sym##_via7};
_Static_assert(GATE_SLOTS == 8, "GATED_DEFINE writes 7 resolver slots");

GATED_CALLS(GATED_DEFINE)

/* A gated call may first be offered to the shim (SHIM_NOT_MINE: not its
 * business): a stream-ordered free of owned memory (owned.c). */
static cuMemFreeAsync_fn cuMemFreeAsync_hook = owned_free_async;

/* The per-thread default stream exports (cuMemcpyAsync_ptsz, ...), for
 * programs built with CUDA_API_PER_THREAD_DEFAULT_STREAM or that dlsym these
 * names: each calls the driver's own per-thread symbol, never the plain one
 * (what NULL means as a stream differs). The resolvers hand the driver's
 * per-thread pointers out through the plain call's slots. */
#define PER_THREAD_EXPORT(name, cls, hook, params, args)                                  \
    typedef CUresult(CUDAAPI *name##_fn) params;                                          \
    static void *name##_driver;                                                           \
    GATED_EXPORT(name, name##_fn, &name##_driver, #name, cls, hook, params, args)
#define PER_THREAD_none(sym, cls, params, args)
#define PER_THREAD_ptsz(sym, cls, params, args)                                           \
    PER_THREAD_EXPORT(sym##_ptsz, cls, sym##_hook, params, args)
#define PER_THREAD_ptds(sym, cls, params, args)                                           \
    PER_THREAD_EXPORT(sym##_ptds, cls, sym##_hook, params, args)
#define PER_THREAD_DEFINE(sym, base, from, until, cls, pt, params, args)                  \
    PER_THREAD_##pt(sym, cls, params, args)

GATED_CALLS(PER_THREAD_DEFINE)

struct gated {
    const char *base;           /* as the resolvers are asked */
    const char *symbol;         /* the driver's export */
    int from, until;            /* the versions whose ABI this is */
    void **slots;
    void *const *vias;
};

#define GATED_ENTRY(sym, base, from, until, cls, pt, params, args) \
    {base, #sym, from, until, sym##_slot, sym##_vias},
static const struct gated gated[] = {GATED_CALLS(GATED_ENTRY)};
#define NGATED (sizeof gated / sizeof gated[0])

/* The wrapper for `p`, the driver's answer for `name` at `version`; NULL
 * when the name is not gated at that version, or every slot is taken. */
static void *gated_for(const char *name, void *p, int version)
{
    for (size_t i = 0; i < NGATED; i++) {
        const struct gated *e = &gated[i];
        if (!same(e->base, name) || version < e->from || version >= e->until)
            continue;
        for (int k = 1; k < GATE_SLOTS; k++) {
            void *none = NULL;
            void *cur = __atomic_load_n(&e->slots[k], __ATOMIC_ACQUIRE);
            if (cur == p)
                return e->vias[k];
            if (!cur && __atomic_compare_exchange_n(&e->slots[k], &none, p, false,
                                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                return e->vias[k];
            if (__atomic_load_n(&e->slots[k], __ATOMIC_ACQUIRE) == p)
                return e->vias[k];
        }
        shim_log(LOG_WARN, "%s@%d: every slot is taken; this entry point is not gated", name,
                 version);
        return NULL;
    }
    return NULL;
}

/* Exported names that dlsym substitutes (exact symbol names). */
struct named {
    const char *name;
    void *fn;
};
static const struct named named[] = {
    {"cuGetProcAddress", (void *)cuGetProcAddress},
    {"cuGetProcAddress_v2", (void *)cuGetProcAddress_v2},
    {"cuGetProcAddress_v2_ptsz", (void *)cuGetProcAddress_v2_ptsz},
    {"cuInit", (void *)cuInit},
    {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemMap", (void *)cuMemMap},
    {"cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemAddressFree", (void *)cuMemAddressFree},
    {"cuMemSetAccess", (void *)cuMemSetAccess},
    {"cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle},
    {"cuMemGetAllocationPropertiesFromHandle", (void *)cuMemGetAllocationPropertiesFromHandle},
    {"cuMemExportToShareableHandle", (void *)cuMemExportToShareableHandle},
    {"cuMemImportFromShareableHandle", (void *)cuMemImportFromShareableHandle},
    {"cuMulticastCreate", (void *)cuMulticastCreate},
    {"cuMulticastAddDevice", (void *)cuMulticastAddDevice},
    {"cuMulticastBindMem", (void *)cuMulticastBindMem},
    {"cuMulticastBindMem_v2", (void *)cuMulticastBindMem_v2},
    {"cuMulticastBindAddr", (void *)cuMulticastBindAddr},
    {"cuMulticastBindAddr_v2", (void *)cuMulticastBindAddr_v2},
    {"cuMulticastUnbind", (void *)cuMulticastUnbind},
    {"cuMemAlloc_v2", (void *)cuMemAlloc_v2},
    {"cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2},
    {"cuMemFree_v2", (void *)cuMemFree_v2},
    {"cuMemGetAddressRange_v2", (void *)cuMemGetAddressRange_v2},
    {"cuCtxDestroy_v2", (void *)cuCtxDestroy_v2},
    {"cuDevicePrimaryCtxReset_v2", (void *)cuDevicePrimaryCtxReset_v2},
    {"cuDevicePrimaryCtxRelease_v2", (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuPointerGetAttribute", (void *)cuPointerGetAttribute},
    {"cuPointerGetAttributes", (void *)cuPointerGetAttributes},
    {"cuCtxEnablePeerAccess", (void *)cuCtxEnablePeerAccess},
    {"cuCtxDisablePeerAccess", (void *)cuCtxDisablePeerAccess},
    {"cuIpcGetMemHandle", (void *)cuIpcGetMemHandle},
    {"cuIpcOpenMemHandle", (void *)cuIpcOpenMemHandle},
    {"cuIpcOpenMemHandle_v2", (void *)cuIpcOpenMemHandle_v2},
    {"cuIpcCloseMemHandle", (void *)cuIpcCloseMemHandle},
    {"cuMemPoolExportToShareableHandle", (void *)cuMemPoolExportToShareableHandle},
    {"cuMemPoolImportFromShareableHandle", (void *)cuMemPoolImportFromShareableHandle},
    {"cuMemPoolExportPointer", (void *)cuMemPoolExportPointer},
    {"cuMemPoolImportPointer", (void *)cuMemPoolImportPointer},
    {"cuMemPoolDestroy", (void *)cuMemPoolDestroy},
#define GATED_NAMED(sym, base, from, until, cls, pt, params, args) {#sym, (void *)sym},
    GATED_CALLS(GATED_NAMED)
#undef GATED_NAMED
#define NAMED_none(sym)
#define NAMED_ptsz(sym) {#sym "_ptsz", (void *)sym##_ptsz},
#define NAMED_ptds(sym) {#sym "_ptds", (void *)sym##_ptds},
#define PER_THREAD_NAMED(sym, base, from, until, cls, pt, params, args) NAMED_##pt(sym)
    GATED_CALLS(PER_THREAD_NAMED)
#undef PER_THREAD_NAMED
    {"cudaGetDriverEntryPoint", (void *)cudaGetDriverEntryPoint},
    {"cudaGetDriverEntryPoint_ptsz", (void *)cudaGetDriverEntryPoint_ptsz},
    {"cudaGetDriverEntryPointByVersion", (void *)cudaGetDriverEntryPointByVersion},
    {"cudaGetDriverEntryPointByVersion_ptsz", (void *)cudaGetDriverEntryPointByVersion_ptsz},
};
#define NNAMED (sizeof named / sizeof named[0])

/* The runtime's real entry points, learnt from dlsym or RTLD_NEXT. */
enum { RT_EP, RT_EP_PTSZ, RT_EPV, RT_EPV_PTSZ, RT_N };
static void *rt_real[RT_N];
static const char *const rt_names[RT_N] = {
    "cudaGetDriverEntryPoint", "cudaGetDriverEntryPoint_ptsz", "cudaGetDriverEntryPointByVersion",
    "cudaGetDriverEntryPointByVersion_ptsz"};

/* ------------------------------------------------------------ substitution */
/* Which wrapper stands for `p`, the driver's answer for `name` at `version`;
 * NULL when the name is not tracked or the ABI is unknown. */
static void *wrapper_for(const char *name, void *p, int version)
{
    for (size_t i = 0; i < NTRACKED; i++) {
        const struct tracked *t = &tracked[i];
        void *r1, *r2;
        if (!same(t->base, name))
            continue;
        if (!t->v2)
            return t->v1;
        r1 = *t->real_v1;
        r2 = *t->real_v2;
        if (p == r2 && r2)
            return t->v2;
        if (p == r1 && r1)
            return t->v1;
        /* An internal pointer: trust the version, if that ABI exists. */
        if (version >= t->split && r2)
            return t->v2;
        if (version < t->split && r1)
            return t->v1;
        shim_log(LOG_WARN, "cannot tell the ABI of %s at version %d; not intercepted", name,
                 version);
        return NULL;
    }
    return NULL;
}

static void substitute(const char *name, void **pfn, int version)
{
    void *w;
    if (!name || !pfn || !*pfn)
        return;
    w = wrapper_for(name, *pfn, version);
    if (!w)
        w = gated_for(name, *pfn, version);
    if (w) {
        shim_log(LOG_DEBUG, "resolver: %s@%d -> shim", name, version);
        *pfn = w;
    }
}

/* ------------------------------------------------------------ dlsym */
SHIM_NO_SAN void *dlsym(void *handle, const char *name)
{
    shim_dlsym_fn rd = shim_real_dlsym();
    void *p;

    if (!rd)
        return NULL;
    /* RTLD_NEXT is relative to the caller; from here it means "after the
     * shim", which is what a caller loaded after the shim wants. */
    p = rd(handle, name);
    if (!p)
        return p;
    if (name[0] != 'c' || name[1] != 'u')
        return p;
    for (size_t i = 0; i < NNAMED; i++) {
        if (!same(named[i].name, name))
            continue;
        if (named[i].fn == p)
            return p;
        /* The runtime's real entry points are remembered for our wrappers. */
        for (int k = 0; k < RT_N; k++)
            if (same(rt_names[k], name) && !__atomic_load_n(&rt_real[k], __ATOMIC_ACQUIRE))
                __atomic_store_n(&rt_real[k], p, __ATOMIC_RELEASE);
        return named[i].fn;
    }
    return p;
}

/* ------------------------------------------------------------ cuInit */
CUresult CUDAAPI cuInit(unsigned int flags)
{
    CUresult r;
    if (!shim_resolve_real())
        return CUDA_ERROR_NOT_INITIALIZED;
    r = real.cuInit(flags);
    if (r == CUDA_SUCCESS)
        shim_ensure_started();
    return r;
}

/* ------------------------------------------------------------ cuGetProcAddress */
CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r;

    if (!shim_resolve_real())
        return CUDA_ERROR_NOT_INITIALIZED;
    r = real.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, &st);
    if (status)
        *status = st;
    if (r == CUDA_SUCCESS && st == CU_GET_PROC_ADDRESS_SUCCESS && pfn)
        substitute(symbol, pfn, cudaVersion);
    return r;
}

CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                  cuuint64_t flags)
{
    CUresult r;
    if (!shim_resolve_real())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!real.gpa_v1) {
        /* Only the _v2 ABI exists: answer the old call through it. */
        CUdriverProcAddressQueryResult st;
        r = real.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, &st);
        if (r == CUDA_SUCCESS && st != CU_GET_PROC_ADDRESS_SUCCESS)
            r = CUDA_ERROR_NOT_FOUND;
    } else {
        r = real.gpa_v1(symbol, pfn, cudaVersion, flags);
    }
    if (r == CUDA_SUCCESS && pfn)
        substitute(symbol, pfn, cudaVersion);
    return r;
}

/* In cuda.h this is an inline around cuGetProcAddress_v2 that asks for the
 * per-thread default stream; defined here for programs that look it up. */
CUresult CUDAAPI cuGetProcAddress_v2_ptsz(const char *symbol, void **pfn, int cudaVersion,
                                          cuuint64_t flags,
                                          CUdriverProcAddressQueryResult *status)
{
    const cuuint64_t mask =
        CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    if ((flags & mask) == 0)
        flags |= CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status);
}

/* ------------------------------------------------------------ runtime entry points */
static void *rt_get(int k)
{
    void *p = __atomic_load_n(&rt_real[k], __ATOMIC_ACQUIRE);
    shim_dlsym_fn rd;
    if (p)
        return p;
    rd = shim_real_dlsym();
    p = rd ? rd(RTLD_NEXT, rt_names[k]) : NULL;
    if (p)
        __atomic_store_n(&rt_real[k], p, __ATOMIC_RELEASE);
    return p;
}

/* The version-less resolvers answer for the runtime's own version: ask the
 * runtime that owns `entry` (not the shim's headers). 0 when unknown. */
static int rt_version(void *entry)
{
    Dl_info info;
    void *lib;
    int (*get)(int *);
    int v = 0;
    shim_dlsym_fn rd = shim_real_dlsym();

    if (!rd || !dladdr(entry, &info) || !info.dli_fname)
        return 0;
    lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (!lib)
        return 0;
    get = (int (*)(int *))rd(lib, "cudaRuntimeGetVersion");
    if (!get || get(&v) != 0)
        v = 0;
    dlclose(lib);
    return v;
}

#define CUDA_ERROR_SYMBOL_NOT_FOUND_RT 500 /* cudaErrorSymbolNotFound */

static int rt_entry(int k, const char *symbol, void **fp, unsigned long long flags, int *st)
{
    rt_entry_fn f = (rt_entry_fn)rt_get(k);
    int local = -1, r;
    if (!f)
        return CUDA_ERROR_SYMBOL_NOT_FOUND_RT;
    shim_resolve_real();
    r = f(symbol, fp, flags, &local);
    if (st)
        *st = local;
    if (r == 0 && local == 0 && fp && *fp)
        substitute(symbol, fp, rt_version((void *)f));
    return r;
}

static int rt_entry_ver(int k, const char *symbol, void **fp, unsigned int version,
                        unsigned long long flags, int *st)
{
    rt_entry_ver_fn f = (rt_entry_ver_fn)rt_get(k);
    int local = -1, r;
    if (!f)
        return CUDA_ERROR_SYMBOL_NOT_FOUND_RT;
    shim_resolve_real();
    r = f(symbol, fp, version, flags, &local);
    if (st)
        *st = local;
    if (r == 0 && local == 0 && fp && *fp)
        substitute(symbol, fp, (int)version);
    return r;
}

int cudaGetDriverEntryPoint(const char *s, void **fp, unsigned long long flags, int *st)
{
    return rt_entry(RT_EP, s, fp, flags, st);
}

int cudaGetDriverEntryPoint_ptsz(const char *s, void **fp, unsigned long long flags, int *st)
{
    return rt_entry(RT_EP_PTSZ, s, fp, flags, st);
}

int cudaGetDriverEntryPointByVersion(const char *s, void **fp, unsigned int v,
                                     unsigned long long flags, int *st)
{
    return rt_entry_ver(RT_EPV, s, fp, v, flags, st);
}

int cudaGetDriverEntryPointByVersion_ptsz(const char *s, void **fp, unsigned int v,
                                          unsigned long long flags, int *st)
{
    return rt_entry_ver(RT_EPV_PTSZ, s, fp, v, flags, st);
}
