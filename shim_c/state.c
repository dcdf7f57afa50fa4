/*
 * The shared state (`g`) and its lock, and entering the shim.
 *
 * The server starts lazily, on the first tracked call or the first
 * successful cuInit (the shim never initialises CUDA on the application's
 * behalf). What starting means is lifecycle.c's business: it registers the
 * start from its constructor, so this file, which every other file builds
 * on, needs nothing above it.
 */
#include "shim.h"

#include <string.h>
#include <unistd.h>

SHIM_HIDDEN struct shim_state g = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .init_lock = PTHREAD_MUTEX_INITIALIZER,
    .phase = CUIP_PHASE_ACTIVE,
    .listen_fd = -1,
    .lease = {.pidfd = -1},
};

/* Both under g.init_lock. */
static void (*starter)(void);
/* An entry point ran before the registration: a constructor of a library
 * initialised before the shim's (the preloaded library's constructor runs
 * after those of the libraries it does not depend on). */
static bool start_wanted;

void shim_set_starter(void (*start)(void))
{
    bool wanted;

    pthread_mutex_lock(&g.init_lock);
    starter = start;
    wanted = start_wanted;
    start_wanted = false;
    pthread_mutex_unlock(&g.init_lock);
    if (wanted)
        shim_ensure_started();
}

void shim_ensure_started(void)
{
    pid_t me = getpid();
    if (__atomic_load_n(&g.started_pid, __ATOMIC_ACQUIRE) == me)
        return;
    pthread_mutex_lock(&g.init_lock);
    if (g.started_pid != me) {
        if (starter) {
            starter();
            __atomic_store_n(&g.started_pid, me, __ATOMIC_RELEASE);
        } else {
            start_wanted = true;
        }
    }
    pthread_mutex_unlock(&g.init_lock);
}

CUresult shim_enter(void)
{
    if (!shim_resolve_real())
        return CUDA_ERROR_NOT_INITIALIZED;
    shim_ensure_started();
    return CUDA_SUCCESS;
}

void app_gate_lock(const char *call)
{
    /* In flight from the gate until g.lock is held: QUIESCE changes the
     * phase under g.lock only after every call in flight has left, so the
     * phase this call sees stays until it unlocks. */
    gate_enter(GATE_LAUNCH, call);
    pthread_mutex_lock(&g.lock);
    gate_leave(GATE_LAUNCH);
}

CUresult app_lock_at(const char *call)
{
    CUresult r = shim_enter();
    if (r != CUDA_SUCCESS)
        return r;
    app_gate_lock(call);
    if (g.phase != CUIP_PHASE_ACTIVE) {
        pthread_mutex_unlock(&g.lock);
        return CUDA_ERROR_NOT_READY;
    }
    return CUDA_SUCCESS;
}

CUresult app_lock_driver(const char *call, void *const *fn)
{
    CUresult r = app_lock_at(call);
    if (r == CUDA_SUCCESS && !*fn) {
        pthread_mutex_unlock(&g.lock);
        r = CUDA_ERROR_NOT_SUPPORTED; /* a driver older than the call */
    }
    return r;
}

void shim_state_after_fork(void)
{
    /* Only this thread survives: the locks may have been held by threads
     * that no longer exist. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&g.lock, &fresh, sizeof fresh);
    memcpy(&g.init_lock, &fresh, sizeof fresh);
    g.started_pid = 0;
    g.phase = CUIP_PHASE_ACTIVE;
    g.busy = false;
    g.reason[0] = 0;
    memset(g.participant, 0, sizeof g.participant);
    /* The parent's coordinator is not ours: the child's socket is new. */
    if (g.lease.pidfd >= 0)
        close(g.lease.pidfd);
    memset(&g.lease, 0, sizeof g.lease);
    g.lease.pidfd = -1;
    gate_after_fork();
}
