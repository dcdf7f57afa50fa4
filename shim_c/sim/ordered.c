/* Stream-ordered work that is not a copy: value writes and waits (and their
 * batch form); stream-ordered allocation is pool.c's.
 *
 * A write or a wait is checked when called (a mapped, accessible, aligned
 * device word) and queued on its stream like a copy (device.c): a wait holds
 * its queue until the word satisfies it, as it holds a GPU stream, so later
 * work on that stream waits too. Memory gone when the work runs fails the
 * context (the GPU's illegal address). */
#include "sim.h"

#include <time.h>

#define WAIT_POLL_NS 20000L /* how often a queued wait looks at its word again */
#define BATCH_MAX_OPS 256   /* cuStreamBatchMemOp's documented limit */

/* ---- value writes and waits ------------------------------------------- */

static CUresult word_check(uintptr_t addr, size_t width, int dev, int write)
{
    CUresult r;

    if (addr == 0 || addr % width != 0)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    r = sim_is_device_ptr(addr) ? sim_range_check(addr, width, dev, write)
                                : CUDA_ERROR_INVALID_VALUE;
    sim_unlock();
    return r;
}

static CUresult run_write(struct sim_work *w)
{
    CUresult r;

    sim_lock();
    r = sim_range_check(w->dst, w->width, w->dev, 1);
    if (r == CUDA_SUCCESS) {
        if (w->width == 4)
            __atomic_store_n((uint32_t *)w->dst, (uint32_t)w->value64, __ATOMIC_SEQ_CST);
        else
            __atomic_store_n((uint64_t *)w->dst, w->value64, __ATOMIC_SEQ_CST);
        r = sim_mc_mirror(w->dst, w->width);
    }
    sim_unlock();
    return r == CUDA_SUCCESS ? r : CUDA_ERROR_ILLEGAL_ADDRESS;
}

static int satisfied(uint64_t have, uint64_t want, size_t width, unsigned how)
{
    switch (how) {
    case CU_STREAM_WAIT_VALUE_GEQ:
        /* cyclic, as cuda.h defines it */
        return width == 4 ? (int32_t)((uint32_t)have - (uint32_t)want) >= 0
                          : (int64_t)(have - want) >= 0;
    case CU_STREAM_WAIT_VALUE_EQ:
        return have == want;
    case CU_STREAM_WAIT_VALUE_AND:
        return (have & want) != 0;
    default: /* NOR */
        return width == 4 ? (uint32_t) ~(have | want) != 0 : ~(have | want) != 0;
    }
}

static CUresult run_wait(struct sim_work *w)
{
    const struct timespec poll = {0, WAIT_POLL_NS};

    for (;;) {
        uint64_t have = 0;
        CUresult r;

        sim_lock();
        r = sim_range_check(w->src, w->width, w->dev, 0);
        if (r == CUDA_SUCCESS)
            have = w->width == 4 ? __atomic_load_n((uint32_t *)w->src, __ATOMIC_SEQ_CST)
                                 : __atomic_load_n((uint64_t *)w->src, __ATOMIC_SEQ_CST);
        sim_unlock();
        if (r != CUDA_SUCCESS)
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        if (satisfied(have, w->value64, w->width, w->flags & 3u))
            return CUDA_SUCCESS;
        nanosleep(&poll, NULL);
    }
}

/* `v1`: the CUDA 8.0 ABI, which also takes
 * CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER (the _v2 calls do not: cuda.h). */
static CUresult write_value(CUstream s, CUdeviceptr addr, uint64_t value, size_t width,
                            unsigned flags, int v1)
{
    unsigned allowed = v1 ? (unsigned)CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER : 0u;
    int dev;
    CUresult r = sim_current_dev(&dev);

    if (r == CUDA_SUCCESS && (flags & ~allowed))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS)
        r = sim_stream_check(s);
    if (r == CUDA_SUCCESS)
        r = word_check((uintptr_t)addr, width, dev, 1);
    if (r != CUDA_SUCCESS)
        return r;
    return sim_enqueue(s, &(struct sim_work){.run = run_write, .dst = (uintptr_t)addr,
                                             .value64 = value, .width = width});
}

/* No remote writes to flush here: CU_STREAM_WAIT_VALUE_FLUSH is accepted
 * and changes nothing. */
static CUresult wait_value(CUstream s, CUdeviceptr addr, uint64_t value, size_t width,
                           unsigned flags)
{
    int dev;
    CUresult r = sim_current_dev(&dev);

    if (r == CUDA_SUCCESS && (flags & ~(3u | (unsigned)CU_STREAM_WAIT_VALUE_FLUSH)))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS)
        r = sim_stream_check(s);
    if (r == CUDA_SUCCESS)
        r = word_check((uintptr_t)addr, width, dev, 0);
    if (r != CUDA_SUCCESS)
        return r;
    return sim_enqueue(s, &(struct sim_work){.run = run_wait, .src = (uintptr_t)addr,
                                             .value64 = value, .width = width,
                                             .flags = flags});
}

CUresult CUDAAPI cuStreamWriteValue32_v2(CUstream s, CUdeviceptr addr, cuuint32_t value,
                                         unsigned int flags)
{
    SIM_API(write_value(s, addr, value, 4, flags, 0));
}

CUresult CUDAAPI cuStreamWriteValue32_v2_ptsz(CUstream s, CUdeviceptr addr, cuuint32_t value,
                                              unsigned int flags)
{
    SIM_API(write_value(sim_per_thread(s), addr, value, 4, flags, 0));
}

CUresult CUDAAPI cuStreamWriteValue64_v2(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                         unsigned int flags)
{
    SIM_API(write_value(s, addr, value, 8, flags, 0));
}

CUresult CUDAAPI cuStreamWriteValue64_v2_ptsz(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                              unsigned int flags)
{
    SIM_API(write_value(sim_per_thread(s), addr, value, 8, flags, 0));
}

CUresult CUDAAPI cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, cuuint32_t value,
                                        unsigned int flags)
{
    SIM_API(wait_value(s, addr, value, 4, flags));
}

CUresult CUDAAPI cuStreamWaitValue32_v2_ptsz(CUstream s, CUdeviceptr addr, cuuint32_t value,
                                             unsigned int flags)
{
    SIM_API(wait_value(sim_per_thread(s), addr, value, 4, flags));
}

CUresult CUDAAPI cuStreamWaitValue64_v2(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                        unsigned int flags)
{
    SIM_API(wait_value(s, addr, value, 8, flags));
}

CUresult CUDAAPI cuStreamWaitValue64_v2_ptsz(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                             unsigned int flags)
{
    SIM_API(wait_value(sim_per_thread(s), addr, value, 8, flags));
}

/* Each operation checked before any is queued, so that a bad one queues
 * nothing; barriers and flushes order nothing more than the queue does. */
static CUresult batch_one(CUstream s, const CUstreamBatchMemOpParams *p, int dev, int queue,
                          int v1)
{
    switch (p->operation) {
    case CU_STREAM_MEM_OP_WAIT_VALUE_32:
    case CU_STREAM_MEM_OP_WAIT_VALUE_64: {
        size_t width = p->operation == CU_STREAM_MEM_OP_WAIT_VALUE_32 ? 4 : 8;
        uint64_t v = width == 4 ? p->waitValue.value : p->waitValue.value64;
        if (!queue)
            return word_check((uintptr_t)p->waitValue.address, width, dev, 0);
        return wait_value(s, p->waitValue.address, v, width, p->waitValue.flags);
    }
    case CU_STREAM_MEM_OP_WRITE_VALUE_32:
    case CU_STREAM_MEM_OP_WRITE_VALUE_64: {
        size_t width = p->operation == CU_STREAM_MEM_OP_WRITE_VALUE_32 ? 4 : 8;
        uint64_t v = width == 4 ? p->writeValue.value : p->writeValue.value64;
        if (!queue)
            return p->writeValue.flags & ~(v1 ? 1u : 0u)
                       ? CUDA_ERROR_INVALID_VALUE
                       : word_check((uintptr_t)p->writeValue.address, width, dev, 1);
        return write_value(s, p->writeValue.address, v, width, p->writeValue.flags, v1);
    }
    case CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES:
        return p->flushRemoteWrites.flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_STREAM_MEM_OP_BARRIER: /* the _v2 ABI's */
        return !v1 && p->memoryBarrier.flags <= CU_STREAM_MEMORY_BARRIER_TYPE_GPU
                   ? CUDA_SUCCESS
                   : CUDA_ERROR_INVALID_VALUE;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

static CUresult batch_mem_op(CUstream s, unsigned count, const CUstreamBatchMemOpParams *ops,
                             unsigned flags, int v1)
{
    int dev;
    CUresult r = sim_current_dev(&dev);

    if (r != CUDA_SUCCESS)
        return r;
    if (!ops || count == 0 || count > BATCH_MAX_OPS || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_stream_check(s);
    for (unsigned i = 0; i < count && r == CUDA_SUCCESS; i++)
        r = batch_one(s, &ops[i], dev, 0, v1);
    for (unsigned i = 0; i < count && r == CUDA_SUCCESS; i++)
        r = batch_one(s, &ops[i], dev, 1, v1);
    return r;
}

CUresult CUDAAPI cuStreamBatchMemOp_v2(CUstream s, unsigned int count,
                                       CUstreamBatchMemOpParams *paramArray, unsigned int flags)
{
    SIM_API(batch_mem_op(s, count, paramArray, flags, 0));
}

CUresult CUDAAPI cuStreamBatchMemOp_v2_ptsz(CUstream s, unsigned int count,
                                            CUstreamBatchMemOpParams *paramArray,
                                            unsigned int flags)
{
    SIM_API(batch_mem_op(sim_per_thread(s), count, paramArray, flags, 0));
}

/* The CUDA 8.0 ABI: same signatures; writes may skip the memory barrier. */
CUresult CUDAAPI sim_wait_value32_v1(CUstream s, CUdeviceptr addr, cuuint32_t value,
                                     unsigned int flags)
{
    SIM_API(wait_value(s, addr, value, 4, flags));
}

CUresult CUDAAPI sim_wait_value32_v1_ptsz(CUstream s, CUdeviceptr addr, cuuint32_t value,
                                          unsigned int flags)
{
    SIM_API(wait_value(sim_per_thread(s), addr, value, 4, flags));
}

CUresult CUDAAPI sim_wait_value64_v1(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                     unsigned int flags)
{
    SIM_API(wait_value(s, addr, value, 8, flags));
}

CUresult CUDAAPI sim_wait_value64_v1_ptsz(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                          unsigned int flags)
{
    SIM_API(wait_value(sim_per_thread(s), addr, value, 8, flags));
}

CUresult CUDAAPI sim_write_value32_v1(CUstream s, CUdeviceptr addr, cuuint32_t value,
                                      unsigned int flags)
{
    SIM_API(write_value(s, addr, value, 4, flags, 1));
}

CUresult CUDAAPI sim_write_value32_v1_ptsz(CUstream s, CUdeviceptr addr, cuuint32_t value,
                                           unsigned int flags)
{
    SIM_API(write_value(sim_per_thread(s), addr, value, 4, flags, 1));
}

CUresult CUDAAPI sim_write_value64_v1(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                      unsigned int flags)
{
    SIM_API(write_value(s, addr, value, 8, flags, 1));
}

CUresult CUDAAPI sim_write_value64_v1_ptsz(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                           unsigned int flags)
{
    SIM_API(write_value(sim_per_thread(s), addr, value, 8, flags, 1));
}

CUresult CUDAAPI sim_batch_mem_op_v1(CUstream s, unsigned int count,
                                     CUstreamBatchMemOpParams *paramArray, unsigned int flags)
{
    SIM_API(batch_mem_op(s, count, paramArray, flags, 1));
}

CUresult CUDAAPI sim_batch_mem_op_v1_ptsz(CUstream s, unsigned int count,
                                          CUstreamBatchMemOpParams *paramArray,
                                          unsigned int flags)
{
    SIM_API(batch_mem_op(sim_per_thread(s), count, paramArray, flags, 1));
}
