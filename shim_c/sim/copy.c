/* Copies (1D, 2D, 3D, peer, batch), memsets and host memory, with their
 * per-thread default stream variants (_ptsz, _ptds).
 *
 * Every device pointer is checked against the mapping bookkeeping before a
 * byte moves (mapped throughout, and accessible to the calling context's
 * device); a bad range returns CUDA_ERROR_INVALID_VALUE, which is what the
 * real driver's copies return for pointers it does not know. The tables
 * stay locked for the copy so that no unmap can race it. Async variants
 * are checked when called and queued on their stream (device.c); when the
 * work runs, its ranges are checked again: memory unmapped meanwhile fails
 * the context (the GPU's illegal address) and no byte moves. Synchronous
 * variants first wait for the legacy stream's work, as the driver's do (the
 * _ptds ones for the calling thread's default stream). */
#include "sim.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

/* Is p a device pointer (inside a reservation)? Then check it. */
static CUresult check_side(uintptr_t p, size_t n, int dev, int write, int must_be_device)
{
    if (p == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (sim_is_device_ptr(p))
        return sim_copy_range_check(p, n, dev, write);
    return must_be_device ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* Device ranges are checked against the bookkeeping; host pointers cannot
 * be, so the bytes move through the kernel (process_vm_readv on ourselves),
 * which reports a bad host pointer as EFAULT instead of a SIGSEGV in the
 * driver. Where the call is not allowed (seccomp), plain memmove. */
static CUresult move_bytes(void *dst, const void *src, size_t n)
{
    struct iovec local = {dst, n}, remote = {(void *)src, n};
    ssize_t k = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);

    if (k == (ssize_t)n)
        return CUDA_SUCCESS;
    if (k < 0 && (errno == ENOSYS || errno == EPERM)) {
        memmove(dst, src, n);
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* On device `dev`; dst_dev / src_dev: that side must be device memory. */
static CUresult copy_on(uintptr_t dst, uintptr_t src, size_t n, int dst_dev, int src_dev, int dev)
{
    CUresult r;

    if (n == 0)
        return CUDA_SUCCESS;
    sim_lock();
    r = check_side(dst, n, dev, 1, dst_dev);
    if (r == CUDA_SUCCESS)
        r = check_side(src, n, dev, 0, src_dev);
    if (r == CUDA_SUCCESS)
        r = move_bytes((void *)dst, (const void *)src, n);
    if (r == CUDA_SUCCESS && sim_is_device_ptr(dst))
        r = sim_mc_mirror(dst, n);
    sim_unlock();
    return r;
}

static size_t at_least_one(size_t v)
{
    return v ? v : 1;
}

/* Row `r` of slice `z` of one side of `w`. */
static uintptr_t row_at(uintptr_t base, size_t pitch, size_t slice, size_t z, size_t r)
{
    return base + z * slice + r * pitch;
}

/* Every row of `w` on device `dev`; a failure stops at its row. */
static CUresult copy_rows(const struct sim_work *w, int dev)
{
    size_t rows = at_least_one(w->rows), slices = at_least_one(w->slices);
    CUresult r = CUDA_SUCCESS;

    for (size_t z = 0; z < slices && r == CUDA_SUCCESS; z++)
        for (size_t y = 0; y < rows && r == CUDA_SUCCESS; y++)
            r = copy_on(row_at(w->dst, w->dst_pitch, w->dst_slice, z, y),
                        row_at(w->src, w->src_pitch, w->src_slice, z, y), w->n, w->dst_dev,
                        w->src_dev, dev);
    return r;
}

/* sim.mu held: every row of both sides is mapped and accessible. */
static CUresult check_rows(const struct sim_work *w, int dev)
{
    size_t rows = at_least_one(w->rows), slices = at_least_one(w->slices);
    CUresult r = CUDA_SUCCESS;

    for (size_t z = 0; z < slices && r == CUDA_SUCCESS; z++)
        for (size_t y = 0; y < rows && r == CUDA_SUCCESS; y++) {
            r = check_side(row_at(w->dst, w->dst_pitch, w->dst_slice, z, y), w->n, dev, 1,
                           w->dst_dev);
            if (r == CUDA_SUCCESS)
                r = check_side(row_at(w->src, w->src_pitch, w->src_slice, z, y), w->n, dev, 0,
                               w->src_dev);
        }
    return r;
}

static CUresult run_copy(struct sim_work *w)
{
    CUresult r = copy_rows(w, w->dev);

    return r == CUDA_SUCCESS ? r : CUDA_ERROR_ILLEGAL_ADDRESS;
}

/* `queued` of copy_work: checked only, not run (a batch checks every copy
 * before it queues any). */
#define CHECK_ONLY 2

/* A copy checked now; `queued`: run on stream `s` (the Async variants),
 * else now, after the work of stream `s` (NULL: the legacy stream, as the
 * synchronous copies; CU_STREAM_PER_THREAD: the _ptds ones). */
static CUresult copy_work(const struct sim_work *w, CUstream s, int queued)
{
    int dev;
    CUresult r = sim_current_dev(&dev);

    if (r == CUDA_SUCCESS)
        r = sim_stream_check(s);
    if (r != CUDA_SUCCESS || w->n == 0)
        return r;
    sim_lock();
    r = check_rows(w, dev);
    sim_unlock();
    if (r != CUDA_SUCCESS || queued == CHECK_ONLY)
        return r;
    if (queued)
        return sim_enqueue(s, w);
    r = sim_stream_wait(s);
    return r == CUDA_SUCCESS ? copy_rows(w, dev) : r;
}

static CUresult copy1(uintptr_t dst, uintptr_t src, size_t n, int dd, int sd, CUstream s,
                      int queued)
{
    return copy_work(&(struct sim_work){.run = run_copy, .dst = dst, .src = src, .n = n,
                                        .dst_dev = dd, .src_dev = sd},
                     s, queued);
}

#define PT CU_STREAM_PER_THREAD

CUresult CUDAAPI cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    SIM_API(copy1(dst, src, ByteCount, 0, 0, NULL, 0));
}

CUresult CUDAAPI cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    SIM_API(copy1(dst, src, ByteCount, 0, 0, PT, 0));
}

CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount,
                               CUstream hStream)
{
    SIM_API(copy1(dst, src, ByteCount, 0, 0, hStream, 1));
}

CUresult CUDAAPI cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount,
                                    CUstream hStream)
{
    SIM_API(copy1(dst, src, ByteCount, 0, 0, sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    SIM_API(copy1(dstDevice, (uintptr_t)srcHost, ByteCount, 1, 0, NULL, 0));
}

CUresult CUDAAPI cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost,
                                      size_t ByteCount)
{
    SIM_API(copy1(dstDevice, (uintptr_t)srcHost, ByteCount, 1, 0, PT, 0));
}

CUresult CUDAAPI cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_API(copy1((uintptr_t)dstHost, srcDevice, ByteCount, 0, 1, NULL, 0));
}

CUresult CUDAAPI cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_API(copy1((uintptr_t)dstHost, srcDevice, ByteCount, 0, 1, PT, 0));
}

CUresult CUDAAPI cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_API(copy1(dstDevice, srcDevice, ByteCount, 1, 1, NULL, 0));
}

CUresult CUDAAPI cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                      size_t ByteCount)
{
    SIM_API(copy1(dstDevice, srcDevice, ByteCount, 1, 1, PT, 0));
}

static CUresult copy_htod_async(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    CUresult r = sim_fault_due(&sim.fail_copy);

    return r != CUDA_SUCCESS ? r : copy1(dst, (uintptr_t)src, n, 1, 0, s, 1);
}

int cuinterposeSimFailCopy(unsigned skip, CUresult result)
{
    sim_fault_arm(&sim.fail_copy, skip, result);
    return 0;
}

CUresult CUDAAPI cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost,
                                      size_t ByteCount, CUstream hStream)
{
    SIM_API(copy_htod_async(dstDevice, srcHost, ByteCount, hStream));
}

CUresult CUDAAPI cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost,
                                           size_t ByteCount, CUstream hStream)
{
    SIM_API(copy_htod_async(dstDevice, srcHost, ByteCount, sim_per_thread(hStream)));
}

CUresult CUDAAPI cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                      CUstream hStream)
{
    SIM_API(copy1((uintptr_t)dstHost, srcDevice, ByteCount, 0, 1, hStream, 1));
}

CUresult CUDAAPI cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice,
                                           size_t ByteCount, CUstream hStream)
{
    SIM_API(copy1((uintptr_t)dstHost, srcDevice, ByteCount, 0, 1, sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                      size_t ByteCount, CUstream hStream)
{
    SIM_API(copy1(dstDevice, srcDevice, ByteCount, 1, 1, hStream, 1));
}

CUresult CUDAAPI cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                           size_t ByteCount, CUstream hStream)
{
    SIM_API(copy1(dstDevice, srcDevice, ByteCount, 1, 1, sim_per_thread(hStream), 1));
}

/* ---- peer copies ------------------------------------------------------ */

static CUresult peers_valid(CUcontext dctx, CUcontext sctx)
{
    struct sim_ctx *d, *s;

    sim_lock();
    d = sim_ctx_check(dctx);
    s = sim_ctx_check(sctx);
    sim_unlock();
    return d && s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult copy_peer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
                          size_t n, CUstream s, int queued)
{
    CUresult r = peers_valid(dctx, sctx);

    return r == CUDA_SUCCESS ? copy1(dst, src, n, 1, 1, s, queued) : r;
}

CUresult CUDAAPI cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                              CUcontext srcContext, size_t ByteCount)
{
    SIM_API(copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, NULL, 0));
}

CUresult CUDAAPI cuMemcpyPeer_ptds(CUdeviceptr dstDevice, CUcontext dstContext,
                                   CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount)
{
    SIM_API(copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, PT, 0));
}

CUresult CUDAAPI cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext,
                                   CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,
                                   CUstream hStream)
{
    SIM_API(copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount, hStream, 1));
}

CUresult CUDAAPI cuMemcpyPeerAsync_ptsz(CUdeviceptr dstDevice, CUcontext dstContext,
                                        CUdeviceptr srcDevice, CUcontext srcContext,
                                        size_t ByteCount, CUstream hStream)
{
    SIM_API(copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount,
                      sim_per_thread(hStream), 1));
}

/* ---- 2D and 3D copies ------------------------------------------------- */

/* One side of a 2D/3D copy, as the CUDA_MEMCPY* structs give it. */
struct side {
    CUmemorytype type;
    const void *host;
    CUdeviceptr device;
    CUarray array;
    size_t x, y, z, pitch, height;
};

/* sim.mu held: the array `h` names; NULL if none. */
static struct sim_array *array_find(CUarray h)
{
    struct sim_array *a = (struct sim_array *)h;

    return a >= &sim.arrays[0] && a < &sim.arrays[SIM_MAX_ARRAYS] && a->used ? a : NULL;
}

/* An array side of a width x height x depth copy: the array's row length
 * and height are its pitches (set in `s`), and the extent must lie inside
 * it (2D arrays only: no 3D arrays here). */
static CUresult array_side(struct side *s, size_t width, size_t height, size_t depth,
                           uintptr_t *at)
{
    struct sim_array *a;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    sim_lock();
    a = array_find(s->array);
    if (a && s->x + width <= a->row && s->y + height <= a->height && s->z + depth <= 1) {
        s->pitch = a->row;
        s->height = a->height;
        *at = (uintptr_t)a->p + s->y * a->row + s->x;
        r = CUDA_SUCCESS;
    }
    sim_unlock();
    return r;
}

/* Where `s`'s first row starts, and whether that side must be device
 * memory; an array side's pitch and height are the array's (`s` is updated). */
static CUresult side_start(struct side *s, size_t width, size_t height, size_t depth,
                           uintptr_t *at, int *device)
{
    uintptr_t base;

    switch (s->type) {
    case CU_MEMORYTYPE_ARRAY:
        *device = 0; /* host memory here */
        return array_side(s, width, height, depth, at);
    case CU_MEMORYTYPE_HOST:
        base = (uintptr_t)s->host;
        *device = 0;
        break;
    case CU_MEMORYTYPE_DEVICE:
        base = (uintptr_t)s->device;
        *device = 1;
        break;
    case CU_MEMORYTYPE_UNIFIED:
        base = (uintptr_t)s->device;
        *device = 0;
        break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (base == 0)
        return CUDA_ERROR_INVALID_VALUE;
    *at = base + s->z * s->pitch * s->height + s->y * s->pitch + s->x;
    return CUDA_SUCCESS;
}

/* A width x height x depth copy between two sides: rows must fit their
 * pitch, and slices their height, whenever there is more than one. */
static CUresult copy_3d(struct side *d, struct side *s, size_t width, size_t height,
                        size_t depth, CUstream st, int queued)
{
    struct sim_work w = {.run = run_copy, .n = width, .rows = height, .slices = depth};
    CUresult r;

    if (width == 0 || height == 0 || depth == 0)
        return CUDA_SUCCESS;
    r = side_start(d, width, height, depth, &w.dst, &w.dst_dev);
    if (r == CUDA_SUCCESS)
        r = side_start(s, width, height, depth, &w.src, &w.src_dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (height > 1 && (d->pitch < d->x + width || s->pitch < s->x + width))
        return CUDA_ERROR_INVALID_VALUE;
    if (depth > 1 && (d->height < d->y + height || s->height < s->y + height))
        return CUDA_ERROR_INVALID_VALUE;
    w.dst_pitch = d->pitch;
    w.src_pitch = s->pitch;
    w.dst_slice = d->pitch * d->height;
    w.src_slice = s->pitch * s->height;
    return copy_work(&w, st, queued);
}

static CUresult copy_2d(const CUDA_MEMCPY2D *p, CUstream st, int queued)
{
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    return copy_3d(&(struct side){p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray,
                                  p->dstXInBytes, p->dstY, 0, p->dstPitch, 0},
                   &(struct side){p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray,
                                  p->srcXInBytes, p->srcY, 0, p->srcPitch, 0},
                   p->WidthInBytes, p->Height, 1, st, queued);
}

static CUresult copy_3d_desc(const CUDA_MEMCPY3D *p, CUstream st, int queued)
{
    if (!p || p->srcLOD || p->dstLOD || p->reserved0 || p->reserved1)
        return CUDA_ERROR_INVALID_VALUE;
    return copy_3d(&(struct side){p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray,
                                  p->dstXInBytes, p->dstY, p->dstZ, p->dstPitch, p->dstHeight},
                   &(struct side){p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray,
                                  p->srcXInBytes, p->srcY, p->srcZ, p->srcPitch, p->srcHeight},
                   p->WidthInBytes, p->Height, p->Depth, st, queued);
}

static CUresult copy_3d_peer(const CUDA_MEMCPY3D_PEER *p, CUstream st, int queued)
{
    CUresult r;

    if (!p || p->srcLOD || p->dstLOD)
        return CUDA_ERROR_INVALID_VALUE;
    r = peers_valid(p->dstContext, p->srcContext);
    if (r != CUDA_SUCCESS)
        return r;
    return copy_3d(&(struct side){p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray,
                                  p->dstXInBytes, p->dstY, p->dstZ, p->dstPitch, p->dstHeight},
                   &(struct side){p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray,
                                  p->srcXInBytes, p->srcY, p->srcZ, p->srcPitch, p->srcHeight},
                   p->WidthInBytes, p->Height, p->Depth, st, queued);
}

CUresult CUDAAPI cuMemcpy2D_v2(const CUDA_MEMCPY2D *pCopy)
{
    SIM_API(copy_2d(pCopy, NULL, 0));
}

CUresult CUDAAPI cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D *pCopy)
{
    SIM_API(copy_2d(pCopy, PT, 0));
}

CUresult CUDAAPI cuMemcpy2DUnaligned_v2(const CUDA_MEMCPY2D *pCopy)
{
    SIM_API(copy_2d(pCopy, NULL, 0));
}

CUresult CUDAAPI cuMemcpy2DUnaligned_v2_ptds(const CUDA_MEMCPY2D *pCopy)
{
    SIM_API(copy_2d(pCopy, PT, 0));
}

CUresult CUDAAPI cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *pCopy, CUstream hStream)
{
    SIM_API(copy_2d(pCopy, hStream, 1));
}

CUresult CUDAAPI cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *pCopy, CUstream hStream)
{
    SIM_API(copy_2d(pCopy, sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemcpy3D_v2(const CUDA_MEMCPY3D *pCopy)
{
    SIM_API(copy_3d_desc(pCopy, NULL, 0));
}

CUresult CUDAAPI cuMemcpy3D_v2_ptds(const CUDA_MEMCPY3D *pCopy)
{
    SIM_API(copy_3d_desc(pCopy, PT, 0));
}

CUresult CUDAAPI cuMemcpy3DAsync_v2(const CUDA_MEMCPY3D *pCopy, CUstream hStream)
{
    SIM_API(copy_3d_desc(pCopy, hStream, 1));
}

CUresult CUDAAPI cuMemcpy3DAsync_v2_ptsz(const CUDA_MEMCPY3D *pCopy, CUstream hStream)
{
    SIM_API(copy_3d_desc(pCopy, sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemcpy3DPeer(const CUDA_MEMCPY3D_PEER *pCopy)
{
    SIM_API(copy_3d_peer(pCopy, NULL, 0));
}

CUresult CUDAAPI cuMemcpy3DPeer_ptds(const CUDA_MEMCPY3D_PEER *pCopy)
{
    SIM_API(copy_3d_peer(pCopy, PT, 0));
}

CUresult CUDAAPI cuMemcpy3DPeerAsync(const CUDA_MEMCPY3D_PEER *pCopy, CUstream hStream)
{
    SIM_API(copy_3d_peer(pCopy, hStream, 1));
}

CUresult CUDAAPI cuMemcpy3DPeerAsync_ptsz(const CUDA_MEMCPY3D_PEER *pCopy, CUstream hStream)
{
    SIM_API(copy_3d_peer(pCopy, sim_per_thread(hStream), 1));
}

/* ---- batch copies ----------------------------------------------------- */

static int access_order_valid(CUmemcpySrcAccessOrder o)
{
    return o == CU_MEMCPY_SRC_ACCESS_ORDER_STREAM ||
           o == CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL || o == CU_MEMCPY_SRC_ACCESS_ORDER_ANY;
}

/* The attribute list as cuda.h describes it: attrsIdxs starts at 0, rises,
 * stays below count; every entry has a valid access order. */
static CUresult batch_attrs_valid(size_t count, const CUmemcpyAttributes *attrs,
                                  const size_t *idxs, size_t nattrs)
{
    if (!attrs || !idxs || nattrs == 0 || nattrs > count || idxs[0] != 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; k < nattrs; k++) {
        if ((k && idxs[k] <= idxs[k - 1]) || idxs[k] >= count)
            return CUDA_ERROR_INVALID_VALUE;
        if (!access_order_valid(attrs[k].srcAccessOrder))
            return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* Not on the legacy NULL stream (cuda.h); each copy queued as cuMemcpyAsync
 * would queue it. `*fail`: the copy that failed, SIZE_MAX for none. */
static CUresult copy_batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                           CUmemcpyAttributes *attrs, size_t *idxs, size_t nattrs, size_t *fail,
                           CUstream s)
{
    CUresult r;

    *fail = SIZE_MAX;
    if (!dsts || !srcs || !sizes || count == 0 || s == NULL || s == CU_STREAM_LEGACY)
        return CUDA_ERROR_INVALID_VALUE;
    r = batch_attrs_valid(count, attrs, idxs, nattrs);
    for (size_t i = 0; i < count && r == CUDA_SUCCESS; i++) {
        r = copy1(dsts[i], srcs[i], sizes[i], 0, 0, s, CHECK_ONLY);
        if (r != CUDA_SUCCESS)
            *fail = i;
    }
    for (size_t i = 0; i < count && r == CUDA_SUCCESS; i++)
        r = copy1(dsts[i], srcs[i], sizes[i], 0, 0, s, 1);
    return r;
}

static CUresult copy_batch_v1(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                              CUmemcpyAttributes *attrs, size_t *idxs, size_t nattrs,
                              size_t *failIdx, CUstream s)
{
    size_t fail;
    CUresult r = copy_batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, &fail, s);

    if (failIdx)
        *failIdx = fail;
    return r;
}

CUresult CUDAAPI sim_memcpy_batch_v1(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                     size_t count, CUmemcpyAttributes *attrs, size_t *attrsIdxs,
                                     size_t numAttrs, size_t *failIdx, CUstream hStream)
{
    SIM_API(copy_batch_v1(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream));
}

CUresult CUDAAPI cuMemcpyBatchAsync_ptsz(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                         size_t count, CUmemcpyAttributes *attrs,
                                         size_t *attrsIdxs, size_t numAttrs, size_t *failIdx,
                                         CUstream hStream)
{
    SIM_API(copy_batch_v1(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx,
                          sim_per_thread(hStream)));
}

CUresult CUDAAPI cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                       size_t count, CUmemcpyAttributes *attrs,
                                       size_t *attrsIdxs, size_t numAttrs, CUstream hStream)
{
    SIM_API(copy_batch_v1(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, NULL, hStream));
}

CUresult CUDAAPI cuMemcpyBatchAsync_v2_ptsz(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                            size_t count, CUmemcpyAttributes *attrs,
                                            size_t *attrsIdxs, size_t numAttrs, CUstream hStream)
{
    SIM_API(copy_batch_v1(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, NULL,
                          sim_per_thread(hStream)));
}

/* A pointer operand of a 3D batch copy (the only kind here: no arrays). */
static CUresult operand_side(const CUmemcpy3DOperand *o, const CUextent3D *e, struct side *s)
{
    size_t row, layer;

    if (o->type != CU_MEMCPY_OPERAND_TYPE_POINTER)
        return CUDA_ERROR_INVALID_VALUE;
    row = o->op.ptr.rowLength;
    layer = o->op.ptr.layerHeight;
    if ((row && row < e->width) || (layer && layer < e->height))
        return CUDA_ERROR_INVALID_VALUE;
    *s = (struct side){.type = CU_MEMORYTYPE_UNIFIED, .device = o->op.ptr.ptr,
                       .pitch = row ? row : e->width, .height = layer ? layer : e->height};
    return CUDA_SUCCESS;
}

static CUresult batch_op(const CUDA_MEMCPY3D_BATCH_OP *op, CUstream s, int queued)
{
    struct side d, src;
    CUresult r = CUDA_SUCCESS;

    if (!op->extent.width || !op->extent.height || !op->extent.depth ||
        !access_order_valid(op->srcAccessOrder))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS)
        r = operand_side(&op->dst, &op->extent, &d);
    if (r == CUDA_SUCCESS)
        r = operand_side(&op->src, &op->extent, &src);
    if (r == CUDA_SUCCESS)
        r = copy_3d(&d, &src, op->extent.width, op->extent.height, op->extent.depth, s, queued);
    return r;
}

static CUresult copy_3d_batch(size_t n, CUDA_MEMCPY3D_BATCH_OP *ops, size_t *failIdx,
                              unsigned long long flags, CUstream s)
{
    CUresult r = CUDA_SUCCESS;

    if (failIdx)
        *failIdx = SIZE_MAX;
    if (!ops || n == 0 || flags != 0 || s == NULL || s == CU_STREAM_LEGACY)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < n && r == CUDA_SUCCESS; i++) {
        r = batch_op(&ops[i], s, CHECK_ONLY);
        if (r != CUDA_SUCCESS && failIdx)
            *failIdx = i;
    }
    for (size_t i = 0; i < n && r == CUDA_SUCCESS; i++)
        r = batch_op(&ops[i], s, 1);
    return r;
}

CUresult CUDAAPI sim_memcpy_3d_batch_v1(size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList,
                                        size_t *failIdx, unsigned long long flags,
                                        CUstream hStream)
{
    SIM_API(copy_3d_batch(numOps, opList, failIdx, flags, hStream));
}

CUresult CUDAAPI cuMemcpy3DBatchAsync_ptsz(size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList,
                                           size_t *failIdx, unsigned long long flags,
                                           CUstream hStream)
{
    SIM_API(copy_3d_batch(numOps, opList, failIdx, flags, sim_per_thread(hStream)));
}

CUresult CUDAAPI cuMemcpy3DBatchAsync_v2(size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList,
                                         unsigned long long flags, CUstream hStream)
{
    SIM_API(copy_3d_batch(numOps, opList, NULL, flags, hStream));
}

CUresult CUDAAPI cuMemcpy3DBatchAsync_v2_ptsz(size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList,
                                              unsigned long long flags, CUstream hStream)
{
    SIM_API(copy_3d_batch(numOps, opList, NULL, flags, sim_per_thread(hStream)));
}

/* ---- arrays ----------------------------------------------------------- */

static size_t format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
        return 4;
    default:
        return 0; /* video and block-compressed formats: not simulated */
    }
}

/* Host memory standing for the array (mmap, so that work still queued after
 * cuArrayDestroy meets an unmapped range: an illegal address). */
static CUresult array_create(CUarray *out, const CUDA_ARRAY_DESCRIPTOR *d)
{
    struct sim_array *a = NULL;
    size_t elem, row, height, bytes;
    int dev;
    void *p;
    CUresult r = sim_current_dev(&dev);

    if (r != CUDA_SUCCESS)
        return r;
    if (!out || !d)
        return CUDA_ERROR_INVALID_VALUE;
    elem = format_bytes(d->Format) * d->NumChannels;
    height = d->Height ? d->Height : 1;
    if (!elem || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4) ||
        d->Width == 0 || d->Width > SIZE_MAX / elem || height > SIZE_MAX / (d->Width * elem))
        return CUDA_ERROR_INVALID_VALUE;
    row = d->Width * elem;
    bytes = row * height;
    p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    sim_lock();
    for (int i = 0; i < SIM_MAX_ARRAYS && !a; i++)
        if (!sim.arrays[i].used)
            a = &sim.arrays[i];
    if (a)
        *a = (struct sim_array){.used = 1, .p = p, .bytes = bytes, .row = row, .height = height};
    sim_unlock();
    if (!a) {
        munmap(p, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = (CUarray)a;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    SIM_API(array_create(pHandle, pAllocateArray));
}

static CUresult array_destroy(CUarray h)
{
    struct sim_array *a;
    void *p = NULL;
    size_t bytes = 0;

    sim_lock();
    a = array_find(h);
    if (a) {
        p = a->p;
        bytes = a->bytes;
        memset(a, 0, sizeof *a);
    }
    sim_unlock();
    if (!p)
        return CUDA_ERROR_INVALID_HANDLE;
    munmap(p, bytes);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuArrayDestroy(CUarray hArray)
{
    SIM_API(array_destroy(hArray));
}

/* Byte `off` of array `h`, with `n` bytes after it inside the array. */
static CUresult array_at(CUarray h, size_t off, size_t n, uintptr_t *at)
{
    struct sim_array *a;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    sim_lock();
    a = array_find(h);
    if (a && off <= a->bytes && n <= a->bytes - off) {
        *at = (uintptr_t)a->p + off;
        r = CUDA_SUCCESS;
    }
    sim_unlock();
    return r;
}

/* A linear copy between an array and memory: `to_array` says which way;
 * `device`: the memory side must be device memory (AtoD, DtoA). */
static CUresult copy_array(CUarray h, size_t off, uintptr_t mem, size_t n, int to_array,
                           int device, CUstream s, int queued)
{
    uintptr_t at;
    CUresult r = array_at(h, off, n, &at);

    if (r != CUDA_SUCCESS)
        return r;
    return to_array ? copy1(at, mem, n, 0, device, s, queued)
                    : copy1(mem, at, n, device, 0, s, queued);
}

static CUresult copy_a_to_a(CUarray d, size_t doff, CUarray src, size_t soff, size_t n,
                            CUstream s)
{
    uintptr_t to, from;
    CUresult r = array_at(d, doff, n, &to);

    if (r == CUDA_SUCCESS)
        r = array_at(src, soff, n, &from);
    return r == CUDA_SUCCESS ? copy1(to, from, n, 0, 0, s, 0) : r;
}

CUresult CUDAAPI cuMemcpyAtoH_v2(void *dstHost, CUarray srcArray, size_t srcOffset,
                                 size_t ByteCount)
{
    SIM_API(copy_array(srcArray, srcOffset, (uintptr_t)dstHost, ByteCount, 0, 0, NULL, 0));
}

CUresult CUDAAPI cuMemcpyAtoH_v2_ptds(void *dstHost, CUarray srcArray, size_t srcOffset,
                                      size_t ByteCount)
{
    SIM_API(copy_array(srcArray, srcOffset, (uintptr_t)dstHost, ByteCount, 0, 0, PT, 0));
}

CUresult CUDAAPI cuMemcpyHtoA_v2(CUarray dstArray, size_t dstOffset, const void *srcHost,
                                 size_t ByteCount)
{
    SIM_API(copy_array(dstArray, dstOffset, (uintptr_t)srcHost, ByteCount, 1, 0, NULL, 0));
}

CUresult CUDAAPI cuMemcpyHtoA_v2_ptds(CUarray dstArray, size_t dstOffset, const void *srcHost,
                                      size_t ByteCount)
{
    SIM_API(copy_array(dstArray, dstOffset, (uintptr_t)srcHost, ByteCount, 1, 0, PT, 0));
}

CUresult CUDAAPI cuMemcpyAtoD_v2(CUdeviceptr dstDevice, CUarray srcArray, size_t srcOffset,
                                 size_t ByteCount)
{
    SIM_API(copy_array(srcArray, srcOffset, dstDevice, ByteCount, 0, 1, NULL, 0));
}

CUresult CUDAAPI cuMemcpyAtoD_v2_ptds(CUdeviceptr dstDevice, CUarray srcArray, size_t srcOffset,
                                      size_t ByteCount)
{
    SIM_API(copy_array(srcArray, srcOffset, dstDevice, ByteCount, 0, 1, PT, 0));
}

CUresult CUDAAPI cuMemcpyDtoA_v2(CUarray dstArray, size_t dstOffset, CUdeviceptr srcDevice,
                                 size_t ByteCount)
{
    SIM_API(copy_array(dstArray, dstOffset, srcDevice, ByteCount, 1, 1, NULL, 0));
}

CUresult CUDAAPI cuMemcpyDtoA_v2_ptds(CUarray dstArray, size_t dstOffset, CUdeviceptr srcDevice,
                                      size_t ByteCount)
{
    SIM_API(copy_array(dstArray, dstOffset, srcDevice, ByteCount, 1, 1, PT, 0));
}

CUresult CUDAAPI cuMemcpyAtoA_v2(CUarray dstArray, size_t dstOffset, CUarray srcArray,
                                 size_t srcOffset, size_t ByteCount)
{
    SIM_API(copy_a_to_a(dstArray, dstOffset, srcArray, srcOffset, ByteCount, NULL));
}

CUresult CUDAAPI cuMemcpyAtoA_v2_ptds(CUarray dstArray, size_t dstOffset, CUarray srcArray,
                                      size_t srcOffset, size_t ByteCount)
{
    SIM_API(copy_a_to_a(dstArray, dstOffset, srcArray, srcOffset, ByteCount, PT));
}

CUresult CUDAAPI cuMemcpyAtoHAsync_v2(void *dstHost, CUarray srcArray, size_t srcOffset,
                                      size_t ByteCount, CUstream hStream)
{
    SIM_API(copy_array(srcArray, srcOffset, (uintptr_t)dstHost, ByteCount, 0, 0, hStream, 1));
}

CUresult CUDAAPI cuMemcpyAtoHAsync_v2_ptsz(void *dstHost, CUarray srcArray, size_t srcOffset,
                                           size_t ByteCount, CUstream hStream)
{
    SIM_API(copy_array(srcArray, srcOffset, (uintptr_t)dstHost, ByteCount, 0, 0,
                       sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemcpyHtoAAsync_v2(CUarray dstArray, size_t dstOffset, const void *srcHost,
                                      size_t ByteCount, CUstream hStream)
{
    SIM_API(copy_array(dstArray, dstOffset, (uintptr_t)srcHost, ByteCount, 1, 0, hStream, 1));
}

CUresult CUDAAPI cuMemcpyHtoAAsync_v2_ptsz(CUarray dstArray, size_t dstOffset,
                                           const void *srcHost, size_t ByteCount,
                                           CUstream hStream)
{
    SIM_API(copy_array(dstArray, dstOffset, (uintptr_t)srcHost, ByteCount, 1, 0,
                       sim_per_thread(hStream), 1));
}

/* ---- memset ----------------------------------------------------------- */

static CUresult set_on(uintptr_t dst, unsigned value, size_t count, size_t width, int dev)
{
    CUresult r;

    sim_lock();
    r = check_side(dst, count * width, dev, 1, 1);
    if (r == CUDA_SUCCESS) {
        if (width == 1) {
            memset((void *)dst, (int)(value & 0xff), count);
        } else if (width == 2) {
            uint16_t *p = (uint16_t *)dst;

            for (size_t i = 0; i < count; i++)
                p[i] = (uint16_t)value;
        } else {
            uint32_t *p = (uint32_t *)dst;

            for (size_t i = 0; i < count; i++)
                p[i] = (uint32_t)value;
        }
        r = sim_mc_mirror(dst, count * width);
    }
    sim_unlock();
    return r;
}

/* Each of `w`'s rows (`rows` of them, `dst_pitch` bytes apart; 0 reads as 1). */
static CUresult set_rows(const struct sim_work *w, int dev)
{
    CUresult r = CUDA_SUCCESS;

    for (size_t y = 0; y < at_least_one(w->rows) && r == CUDA_SUCCESS; y++)
        r = set_on(w->dst + y * w->dst_pitch, w->value, w->n, w->width, dev);
    return r;
}

static CUresult run_set(struct sim_work *w)
{
    CUresult r = set_rows(w, w->dev);

    return r == CUDA_SUCCESS ? r : CUDA_ERROR_ILLEGAL_ADDRESS;
}

/* `count` elements of `width` bytes in each of `rows` rows `pitch` bytes
 * apart. `queued`: on stream `s` (the Async variants); else now, after the
 * work of stream `s` (NULL: the legacy stream; CU_STREAM_PER_THREAD: _ptds). */
static CUresult set_2d(uintptr_t dst, size_t pitch, unsigned value, size_t count, size_t rows,
                       size_t width, CUstream s, int queued)
{
    struct sim_work w = {.run = run_set, .dst = dst, .value = value, .n = count,
                         .width = width, .rows = rows, .dst_pitch = pitch};
    int dev;
    CUresult r = sim_current_dev(&dev);

    if (r == CUDA_SUCCESS)
        r = sim_stream_check(s);
    if (r != CUDA_SUCCESS)
        return r;
    if (count == 0 || rows == 0)
        return CUDA_SUCCESS;
    if (dst % width != 0 || count > SIZE_MAX / width)
        return CUDA_ERROR_INVALID_VALUE;
    if (rows > 1 && (pitch < count * width || pitch > SIZE_MAX / rows))
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    for (size_t y = 0; y < rows && r == CUDA_SUCCESS; y++)
        r = check_side(dst + y * pitch, count * width, dev, 1, 1);
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    if (queued)
        return sim_enqueue(s, &w);
    r = sim_stream_wait(s);
    return r == CUDA_SUCCESS ? set_rows(&w, dev) : r;
}

static CUresult set(uintptr_t dst, unsigned value, size_t count, size_t width, CUstream s,
                    int queued)
{
    return set_2d(dst, 0, value, count, 1, width, s, queued);
}

CUresult CUDAAPI cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    SIM_API(set(dstDevice, uc, N, 1, NULL, 0));
}

CUresult CUDAAPI cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    SIM_API(set(dstDevice, uc, N, 1, PT, 0));
}

CUresult CUDAAPI cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N)
{
    SIM_API(set(dstDevice, us, N, 2, NULL, 0));
}

CUresult CUDAAPI cuMemsetD16_v2_ptds(CUdeviceptr dstDevice, unsigned short us, size_t N)
{
    SIM_API(set(dstDevice, us, N, 2, PT, 0));
}

CUresult CUDAAPI cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
    SIM_API(set(dstDevice, ui, N, 4, NULL, 0));
}

CUresult CUDAAPI cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
    SIM_API(set(dstDevice, ui, N, 4, PT, 0));
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N,
                                 CUstream hStream)
{
    SIM_API(set(dstDevice, uc, N, 1, hStream, 1));
}

CUresult CUDAAPI cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char uc, size_t N,
                                      CUstream hStream)
{
    SIM_API(set(dstDevice, uc, N, 1, sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N,
                                  CUstream hStream)
{
    SIM_API(set(dstDevice, us, N, 2, hStream, 1));
}

CUresult CUDAAPI cuMemsetD16Async_ptsz(CUdeviceptr dstDevice, unsigned short us, size_t N,
                                       CUstream hStream)
{
    SIM_API(set(dstDevice, us, N, 2, sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N,
                                  CUstream hStream)
{
    SIM_API(set(dstDevice, ui, N, 4, hStream, 1));
}

CUresult CUDAAPI cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int ui, size_t N,
                                       CUstream hStream)
{
    SIM_API(set(dstDevice, ui, N, 4, sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemsetD2D8_v2(CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc,
                                 size_t Width, size_t Height)
{
    SIM_API(set_2d(dstDevice, dstPitch, uc, Width, Height, 1, NULL, 0));
}

CUresult CUDAAPI cuMemsetD2D8_v2_ptds(CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc,
                                      size_t Width, size_t Height)
{
    SIM_API(set_2d(dstDevice, dstPitch, uc, Width, Height, 1, PT, 0));
}

CUresult CUDAAPI cuMemsetD2D8Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc,
                                   size_t Width, size_t Height, CUstream hStream)
{
    SIM_API(set_2d(dstDevice, dstPitch, uc, Width, Height, 1, hStream, 1));
}

CUresult CUDAAPI cuMemsetD2D8Async_ptsz(CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc,
                                        size_t Width, size_t Height, CUstream hStream)
{
    SIM_API(set_2d(dstDevice, dstPitch, uc, Width, Height, 1, sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemsetD2D16_v2(CUdeviceptr dstDevice, size_t dstPitch, unsigned short us,
                                 size_t Width, size_t Height)
{
    SIM_API(set_2d(dstDevice, dstPitch, us, Width, Height, 2, NULL, 0));
}

CUresult CUDAAPI cuMemsetD2D16_v2_ptds(CUdeviceptr dstDevice, size_t dstPitch, unsigned short us,
                                      size_t Width, size_t Height)
{
    SIM_API(set_2d(dstDevice, dstPitch, us, Width, Height, 2, PT, 0));
}

CUresult CUDAAPI cuMemsetD2D16Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned short us,
                                   size_t Width, size_t Height, CUstream hStream)
{
    SIM_API(set_2d(dstDevice, dstPitch, us, Width, Height, 2, hStream, 1));
}

CUresult CUDAAPI cuMemsetD2D16Async_ptsz(CUdeviceptr dstDevice, size_t dstPitch, unsigned short us,
                                        size_t Width, size_t Height, CUstream hStream)
{
    SIM_API(set_2d(dstDevice, dstPitch, us, Width, Height, 2, sim_per_thread(hStream), 1));
}

CUresult CUDAAPI cuMemsetD2D32_v2(CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui,
                                 size_t Width, size_t Height)
{
    SIM_API(set_2d(dstDevice, dstPitch, ui, Width, Height, 4, NULL, 0));
}

CUresult CUDAAPI cuMemsetD2D32_v2_ptds(CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui,
                                      size_t Width, size_t Height)
{
    SIM_API(set_2d(dstDevice, dstPitch, ui, Width, Height, 4, PT, 0));
}

CUresult CUDAAPI cuMemsetD2D32Async(CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui,
                                   size_t Width, size_t Height, CUstream hStream)
{
    SIM_API(set_2d(dstDevice, dstPitch, ui, Width, Height, 4, hStream, 1));
}

CUresult CUDAAPI cuMemsetD2D32Async_ptsz(CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui,
                                        size_t Width, size_t Height, CUstream hStream)
{
    SIM_API(set_2d(dstDevice, dstPitch, ui, Width, Height, 4, sim_per_thread(hStream), 1));
}

/* ---- host memory ------------------------------------------------------ */

static struct sim_host *host_slot(void)
{
    for (int i = 0; i < SIM_MAX_HOST; i++)
        if (!sim.host[i].used)
            return &sim.host[i];
    return NULL;
}

static struct sim_host *host_find(const void *p)
{
    for (int i = 0; i < SIM_MAX_HOST; i++)
        if (sim.host[i].used && sim.host[i].p == p)
            return &sim.host[i];
    return NULL;
}

/* Pinned host memory is ordinary anonymous memory here; mmap rather than
 * malloc so that large buffers go straight back to the kernel. */
static CUresult host_alloc(void **pp, size_t size, unsigned flags)
{
    struct sim_host *h;
    void *p;

    if (!pp || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
                            CU_MEMHOSTALLOC_WRITECOMBINED))
        return CUDA_ERROR_INVALID_VALUE;
    p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    sim_lock();
    h = host_slot();
    if (h) {
        h->used = 1;
        h->registered = 0;
        h->p = p;
        h->size = size;
        h->flags = flags;
        h->ctx = sim_current_ctx();
    }
    sim_unlock();
    if (!h) {
        munmap(p, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    SIM_API(host_alloc(pp, bytesize, Flags));
}

CUresult CUDAAPI cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    SIM_API(host_alloc(pp, bytesize, 0));
}

static CUresult host_free(void *p)
{
    struct sim_host *h;
    void *addr = NULL;
    size_t size = 0;

    sim_lock();
    h = host_find(p);
    if (h && !h->registered) {
        addr = h->p;
        size = h->size;
        memset(h, 0, sizeof(*h));
    }
    sim_unlock();
    if (!addr)
        return CUDA_ERROR_INVALID_VALUE;
    munmap(addr, size);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFreeHost(void *p)
{
    SIM_API(host_free(p));
}

static CUresult host_register(void *p, size_t size, unsigned flags)
{
    struct sim_host *h;
    CUresult r = CUDA_SUCCESS;

    if (!p || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    if (host_find(p)) {
        r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
        goto out;
    }
    h = host_slot();
    if (!h) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    h->used = 1;
    h->registered = 1;
    h->p = p;
    h->size = size;
    h->flags = flags;
    h->ctx = sim_current_ctx();
out:
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags)
{
    SIM_API(host_register(p, bytesize, Flags));
}

static CUresult host_unregister(void *p)
{
    struct sim_host *h;
    CUresult r = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;

    sim_lock();
    h = host_find(p);
    if (h && h->registered) {
        memset(h, 0, sizeof(*h));
        r = CUDA_SUCCESS;
    }
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuMemHostUnregister(void *p)
{
    SIM_API(host_unregister(p));
}

static CUresult host_devptr(CUdeviceptr *pdptr, void *p, unsigned flags)
{
    struct sim_host *h;

    if (!pdptr || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    h = NULL;
    for (int i = 0; i < SIM_MAX_HOST && !h; i++) {
        struct sim_host *c = &sim.host[i];

        if (c->used && (uintptr_t)p >= (uintptr_t)c->p && (uintptr_t)p - (uintptr_t)c->p < c->size)
            h = c;
    }
    sim_unlock();
    if (!h)
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p; /* unified addressing */
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)
{
    SIM_API(host_devptr(pdptr, p, Flags));
}

static CUresult host_flags(unsigned int *flags, void *p)
{
    struct sim_host *h;

    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    h = host_find(p);
    if (h)
        *flags = h->flags;
    sim_unlock();
    return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemHostGetFlags(unsigned int *pFlags, void *p)
{
    SIM_API(host_flags(pFlags, p));
}
