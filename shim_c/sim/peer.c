/* Peer access between contexts: cuCtxEnablePeerAccess and
 * cuCtxDisablePeerAccess, with the driver's errors.
 *
 * Access is one way (cuda.h): once the current context enabled access to
 * `peer`, the current context's device may access the cuMemAlloc memory of
 * `peer`, the allocations made before and after; disabling takes it away.
 * cuMemAlloc memory of a context is otherwise accessible from its own
 * device only (vmm.c), though copies reach it from any device, as the
 * driver stages them. VMM memory follows cuMemSetAccess, not peer access. */
#include "sim.h"

/* The current context and `peer`, checked; same device is not a peer.
 * Every pair of distinct simulated devices can access each other
 * (cuDeviceCanAccessPeer, device.c). */
static CUresult peer_pair(CUcontext peer, struct sim_ctx **cur, struct sim_ctx **p)
{
    *cur = sim_current_ctx();
    if (!*cur)
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_lock();
    *p = sim_ctx_check(peer);
    sim_unlock();
    if (!*p)
        return CUDA_ERROR_INVALID_CONTEXT;
    return (*p)->dev == (*cur)->dev ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

static CUresult enable_peer(CUcontext peer, unsigned flags)
{
    struct sim_ctx *cur, *p;
    CUresult r;

    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    r = peer_pair(peer, &cur, &p);
    if (r != CUDA_SUCCESS)
        return r;
    sim_lock();
    if (cur->peer[sim_ctx_slot(p)]) {
        r = CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    } else {
        cur->peer[sim_ctx_slot(p)] = 1;
        sim_legacy_access_refresh();
    }
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    SIM_API(enable_peer(peerContext, Flags));
}

static CUresult disable_peer(CUcontext peer)
{
    struct sim_ctx *cur, *p;
    CUresult r = peer_pair(peer, &cur, &p);

    if (r != CUDA_SUCCESS)
        return r;
    sim_lock();
    if (!cur->peer[sim_ctx_slot(p)]) {
        r = CUDA_ERROR_PEER_ACCESS_NOT_ENABLED;
    } else {
        cur->peer[sim_ctx_slot(p)] = 0;
        sim_legacy_access_refresh();
    }
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuCtxDisablePeerAccess(CUcontext peerContext)
{
    SIM_API(disable_peer(peerContext));
}
