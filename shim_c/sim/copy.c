/* Copies, memsets and host memory.
 *
 * Every device pointer is checked against the mapping bookkeeping before a
 * byte moves (mapped throughout, and accessible to the calling context's
 * device); a bad range returns CUDA_ERROR_INVALID_VALUE, which is what the
 * real driver's copies return for pointers it does not know. The tables
 * stay locked for the copy so that no unmap can race it. Async variants
 * are checked when called and queued on their stream (device.c); when the
 * work runs, its ranges are checked again: memory unmapped meanwhile fails
 * the context (the GPU's illegal address) and no byte moves. Synchronous
 * variants first wait for the legacy stream's work, as the driver's do. */
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
        return sim_range_check(p, n, dev, write);
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

static CUresult copy(uintptr_t dst, uintptr_t src, size_t n, int dst_dev, int src_dev)
{
    int dev;
    CUresult r = sim_current_dev(&dev);

    if (r == CUDA_SUCCESS)
        r = sim_legacy_wait();
    return r == CUDA_SUCCESS ? copy_on(dst, src, n, dst_dev, src_dev, dev) : r;
}

static CUresult run_copy(struct sim_work *w)
{
    CUresult r = copy_on(w->dst, w->src, w->n, w->dst_dev, w->src_dev, w->dev);

    return r == CUDA_SUCCESS ? r : CUDA_ERROR_ILLEGAL_ADDRESS;
}

CUresult CUDAAPI cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    SIM_API(copy(dst, src, ByteCount, 0, 0));
}

static CUresult copy_async(uintptr_t dst, uintptr_t src, size_t n, int dd, int sd, CUstream s)
{
    int dev;
    CUresult r = sim_current_dev(&dev);

    if (r == CUDA_SUCCESS)
        r = sim_stream_check(s);
    if (r != CUDA_SUCCESS || n == 0)
        return r;
    sim_lock();
    r = check_side(dst, n, dev, 1, dd);
    if (r == CUDA_SUCCESS)
        r = check_side(src, n, dev, 0, sd);
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    return sim_enqueue(s, &(struct sim_work){.run = run_copy, .dst = dst, .src = src, .n = n,
                                             .dst_dev = dd, .src_dev = sd});
}

CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount,
                               CUstream hStream)
{
    SIM_API(copy_async(dst, src, ByteCount, 0, 0, hStream));
}

CUresult CUDAAPI cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    SIM_API(copy(dstDevice, (uintptr_t)srcHost, ByteCount, 1, 0));
}

CUresult CUDAAPI cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_API(copy((uintptr_t)dstHost, srcDevice, ByteCount, 0, 1));
}

CUresult CUDAAPI cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    SIM_API(copy(dstDevice, srcDevice, ByteCount, 1, 1));
}

CUresult CUDAAPI cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost,
                                      size_t ByteCount, CUstream hStream)
{
    SIM_API(copy_async(dstDevice, (uintptr_t)srcHost, ByteCount, 1, 0, hStream));
}

CUresult CUDAAPI cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                      CUstream hStream)
{
    SIM_API(copy_async((uintptr_t)dstHost, srcDevice, ByteCount, 0, 1, hStream));
}

CUresult CUDAAPI cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                      size_t ByteCount, CUstream hStream)
{
    SIM_API(copy_async(dstDevice, srcDevice, ByteCount, 1, 1, hStream));
}

static CUresult copy_peer(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
                          size_t n)
{
    struct sim_ctx *d, *s;

    sim_lock();
    d = sim_ctx_check(dctx);
    s = sim_ctx_check(sctx);
    sim_unlock();
    if (!d || !s)
        return CUDA_ERROR_INVALID_CONTEXT;
    return copy(dst, src, n, 1, 1);
}

CUresult CUDAAPI cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                              CUcontext srcContext, size_t ByteCount)
{
    SIM_API(copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount));
}

CUresult CUDAAPI cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext,
                                   CUdeviceptr srcDevice, CUcontext srcContext, size_t ByteCount,
                                   CUstream hStream)
{
    CUresult r;

    (void)hStream;
    r = sim_stream_check(hStream);
    if (r != CUDA_SUCCESS)
        return r;
    SIM_API(copy_peer(dstDevice, dstContext, srcDevice, srcContext, ByteCount));
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

static CUresult run_set(struct sim_work *w)
{
    CUresult r = set_on(w->dst, w->value, w->n, w->width, w->dev);

    return r == CUDA_SUCCESS ? r : CUDA_ERROR_ILLEGAL_ADDRESS;
}

/* `queued`: on stream `s` (the Async variants); else now, after the legacy
 * stream's work. */
static CUresult set(uintptr_t dst, unsigned value, size_t count, size_t width, CUstream s,
                    int queued)
{
    int dev;
    CUresult r = sim_current_dev(&dev);

    if (r == CUDA_SUCCESS)
        r = sim_stream_check(s);
    if (r != CUDA_SUCCESS)
        return r;
    if (count == 0)
        return CUDA_SUCCESS;
    if (dst % width != 0 || count > SIZE_MAX / width)
        return CUDA_ERROR_INVALID_VALUE;
    if (!queued) {
        r = sim_legacy_wait();
        return r == CUDA_SUCCESS ? set_on(dst, value, count, width, dev) : r;
    }
    sim_lock();
    r = check_side(dst, count * width, dev, 1, 1);
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    return sim_enqueue(s, &(struct sim_work){.run = run_set, .dst = dst, .value = value,
                                             .n = count, .width = width});
}

CUresult CUDAAPI cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    SIM_API(set(dstDevice, uc, N, 1, NULL, 0));
}

CUresult CUDAAPI cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N)
{
    SIM_API(set(dstDevice, us, N, 2, NULL, 0));
}

CUresult CUDAAPI cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
    SIM_API(set(dstDevice, ui, N, 4, NULL, 0));
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N,
                                 CUstream hStream)
{
    SIM_API(set(dstDevice, uc, N, 1, hStream, 1));
}

CUresult CUDAAPI cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N,
                                  CUstream hStream)
{
    SIM_API(set(dstDevice, us, N, 2, hStream, 1));
}

CUresult CUDAAPI cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N,
                                  CUstream hStream)
{
    SIM_API(set(dstDevice, ui, N, 4, hStream, 1));
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
