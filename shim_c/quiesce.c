/*
 * QUIESCE (specs/quiesce.md): the first op of a capture, before anything is
 * torn down. The gate closes in two steps:
 *   1. synchronizing calls are held, launches flow: every thread runs on to
 *      its next host-synchronizing call, so that the collectives its peers
 *      wait for are launched, and the device work drains;
 *   2. launches are held too; once no gated call is inside the driver, the
 *      device work of every context is confirmed done.
 * "Done" is asked of a helper thread that synchronizes each context in
 * turn; this thread waits for it until the deadline, never longer (a
 * synchronize cannot be bounded). Past the deadline the gate opens again
 * and the op is refused, naming what the threads were held at: the process
 * runs on as if nothing happened.
 */
#include "shim.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONTEXTS 64

/* One look at whether every context is idle; shared by the control thread
 * and the helper, freed by whichever lets go of it last. */
struct idle_check {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool done;
    CUresult rc;
    uint32_t n;
    uint32_t failed;                 /* the context whose call failed */
    const char *call;                /* that call */
    CUcontext ctx[MAX_CONTEXTS];
    int primary_of[MAX_CONTEXTS];    /* retained primary context of this device; -1 */
};

static void idle_check_put(struct idle_check *c)
{
    bool last;

    pthread_mutex_lock(&c->mu);
    last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) {
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->cv);
        free(c);
    }
}

static void *idle_main(void *arg)
{
    struct idle_check *c = arg;
    CUresult rc = CUDA_SUCCESS;

    for (uint32_t k = 0; k < c->n && rc == CUDA_SUCCESS; k++) {
        bool pushed;

        c->call = "cuCtxPushCurrent";
        rc = shim_ctx_enter(c->ctx[k], &pushed);
        if (rc == CUDA_SUCCESS) {
            c->call = "cuCtxSynchronize";
            rc = real.cuCtxSynchronize();
            shim_ctx_leave(pushed);
        }
        if (rc != CUDA_SUCCESS)
            c->failed = k;
    }
    for (uint32_t k = 0; k < c->n; k++)
        if (c->primary_of[k] >= 0)
            real.cuDevicePrimaryCtxRelease(c->primary_of[k]);
    pthread_mutex_lock(&c->mu);
    c->done = true;
    c->rc = rc;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    idle_check_put(c);
    return NULL;
}

static bool add_context(struct idle_check *c, CUcontext ctx)
{
    for (uint32_t k = 0; k < c->n; k++)
        if (c->ctx[k] == ctx)
            return true;
    if (c->n == MAX_CONTEXTS)
        return false;
    c->primary_of[c->n] = -1;
    c->ctx[c->n++] = ctx;
    return true;
}

/* The contexts of the shim's objects and every active primary context (the
 * runtime's): those the application's work can be queued in. */
static int collect_contexts(struct idle_check *c, char *msg, size_t n)
{
    int devices = 0;
    bool fits = true;

    pthread_mutex_lock(&g.lock);
    for (uint32_t i = 0; i < obj_count() && fits; i++) {
        const struct obj *o = obj_at(i);
        if (o && o->ctx)
            fits = add_context(c, o->ctx);
    }
    pthread_mutex_unlock(&g.lock);
    if (real.cuDeviceGetCount && real.cuDevicePrimaryCtxGetState &&
        real.cuDevicePrimaryCtxRetain && real.cuDevicePrimaryCtxRelease &&
        real.cuDeviceGetCount(&devices) != CUDA_SUCCESS)
        devices = 0;
    for (int d = 0; d < devices && fits; d++) {
        unsigned flags;
        int active = 0;
        CUcontext ctx;
        uint32_t before = c->n;

        if (real.cuDevicePrimaryCtxGetState(d, &flags, &active) != CUDA_SUCCESS || !active ||
            real.cuDevicePrimaryCtxRetain(&ctx, d) != CUDA_SUCCESS)
            continue;
        fits = add_context(c, ctx);
        if (fits && c->n > before)
            c->primary_of[before] = d;
        else
            real.cuDevicePrimaryCtxRelease(d); /* known already, or no room */
    }
    if (!fits) {
        snprintf(msg, n, "more than %d contexts to watch", MAX_CONTEXTS);
        for (uint32_t k = 0; k < c->n; k++)
            if (c->primary_of[k] >= 0)
                real.cuDevicePrimaryCtxRelease(c->primary_of[k]);
        return -1;
    }
    return 0;
}

/* 1: every context idle; 0: not by `deadline_ns` (msg says what); -1: a
 * synchronize failed or nothing could be asked (msg). */
static int device_idle(uint64_t deadline_ns, char *msg, size_t n)
{
    struct idle_check *c = calloc(1, sizeof *c);
    pthread_attr_t at;
    pthread_t t;
    int rc;

    if (!c) {
        snprintf(msg, n, "out of memory");
        return -1;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->refs = 2;
    if (!real.cuCtxSynchronize || collect_contexts(c, msg, n) != 0) {
        if (!real.cuCtxSynchronize)
            snprintf(msg, n, "the driver has no cuCtxSynchronize");
        c->refs = 1;
        idle_check_put(c);
        return -1;
    }
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&t, &at, idle_main, c);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        for (uint32_t k = 0; k < c->n; k++)
            if (c->primary_of[k] >= 0)
                real.cuDevicePrimaryCtxRelease(c->primary_of[k]);
        snprintf(msg, n, "cannot start a thread: %s", strerror(rc));
        c->refs = 1;
        idle_check_put(c);
        return -1;
    }
    pthread_mutex_lock(&c->mu);
    while (!c->done) {
        uint64_t now = shim_now_ns();
        struct timespec ts;
        uint64_t left;

        if (now >= deadline_ns)
            break;
        left = deadline_ns - now;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += (time_t)(left / 1000000000u);
        ts.tv_nsec += (long)(left % 1000000000u);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    if (!c->done) {
        rc = 0;
        snprintf(msg, n, "device work still running in %u context%s", c->n,
                 c->n == 1 ? "" : "s");
    } else if (c->rc != CUDA_SUCCESS) {
        rc = -1;
        snprintf(msg, n, "context %u of %u: %s failed: %s", c->failed + 1, c->n, c->call,
                 shim_cu_name(c->rc));
    } else {
        rc = 1;
    }
    pthread_mutex_unlock(&c->mu);
    idle_check_put(c);
    return rc;
}

/* Step 1, then step 2, until the process is quiet or `deadline`: 1 quiet,
 * 0 not (why says what), -1 a synchronize failed (why). A step 2 that finds
 * work again goes back to step 1: a thread held at a launch in step 2 may
 * be what a peer waits for. */
static int quiet_by(uint64_t deadline, const char **stage, char *why, size_t n)
{
    int idle;

    for (;;) {
        *stage = "with synchronizing calls held and launches flowing";
        idle = device_idle(deadline, why, n);
        if (idle != 1)
            return idle;
        *stage = "with every gated call held";
        gate_close(GATE_HOLD_ALL);
        if (!gate_wait_calls(deadline)) {
            snprintf(why, n, "calls still inside the driver");
            idle = 0;
        } else {
            idle = device_idle(deadline, why, n);
        }
        if (idle != 0 || shim_now_ns() >= deadline)
            return idle;
        gate_close(GATE_HOLD_SYNC);
    }
}

enum phase_result quiesce_run(struct reply *r)
{
    uint64_t own = (uint64_t)shim_settings()->quiesce_timeout_ms * 1000000ull;
    uint64_t asked, now, started, limit, deadline;
    const char *stage = "with synchronizing calls held and launches flowing";
    unsigned granted = 0, advances;
    bool round, advance;
    char why[160], held[600], moved[48] = "";
    int idle;

    pthread_mutex_lock(&g.lock);
    asked = g.quiesce_deadline_ns;
    round = g.quiesce_round;
    started = g.quiesce_started_ns;
    pthread_mutex_unlock(&g.lock);
    now = shim_now_ns();
    if (!shim_settings()->gate) {
        deadline = now + (asked && asked < own ? asked : own);
        idle = device_idle(deadline, why, sizeof why);
        if (idle == 1)
            return PHASE_DONE;
        reply_msg(r, idle < 0 ? CUIP_STATUS_CUDA_FAILED : CUIP_STATUS_REFUSED,
                  "QUIESCE: pid %d (gate off) did not drain within %.0f ms: %s", (int)getpid(),
                  (double)(deadline - now) / 1e6, why);
        return PHASE_REFUSED;
    }
    /* An open gate starts a capture's quiescing; a closed one is a later
     * round: still closing (ACTIVE), or an advance (control.c made a
     * QUIESCED process ACTIVE for it). */
    advance = gate_level() == GATE_HOLD_ALL;
    if (gate_level() == GATE_OPEN) {
        started = now;
        pthread_mutex_lock(&g.lock);
        g.quiesce_started_ns = started;
        g.quiesce_advances = 0;
        pthread_mutex_unlock(&g.lock);
        gate_close(GATE_HOLD_SYNC);
    }
    limit = started + own;
    deadline = asked && now + asked < limit ? now + asked : limit;
    if (advance) {
        pthread_mutex_lock(&g.lock);
        g.quiesce_advances++;
        pthread_mutex_unlock(&g.lock);
        granted = gate_advance();
        if (!gate_wait_passes(deadline)) {
            idle = 0;
            snprintf(why, sizeof why, "threads granted a call did not take it");
            goto not_quiet;
        }
    }
    idle = quiet_by(deadline, &stage, why, sizeof why);
    if (idle == 1) {
        cuip_set_quiesce_held(&r->h, gate_held());
        shim_log(LOG_INFO, "quiet after %.1f ms (%u thread%s held; this advance granted %u "
                 "synchronizing calls)", (double)(shim_now_ns() - started) / 1e6,
                 (unsigned)cuip_quiesce_held(&r->h), cuip_quiesce_held(&r->h) == 1 ? "" : "s",
                 granted);
        return PHASE_DONE;
    }
not_quiet:
    gate_describe(held, sizeof held);
    pthread_mutex_lock(&g.lock);
    advances = g.quiesce_advances;
    pthread_mutex_unlock(&g.lock);
    /* A process advanced while its peers were busy was quiet before: say so. */
    if (advances)
        snprintf(moved, sizeof moved, " (advanced %u time%s)", advances,
                 advances == 1 ? "" : "s");
    if (idle == 0 && round && shim_now_ns() < limit) {
        gate_close(GATE_HOLD_SYNC);
        cuip_set_quiesce_held(&r->h, gate_held());
        reply_msg(r, CUIP_STATUS_PENDING,
                  "QUIESCE: pid %d not quiet yet after %.0f ms%s %s: %s; %s; the gate stays "
                  "closed until the next round",
                  (int)getpid(), (double)(shim_now_ns() - started) / 1e6, moved, stage, why,
                  held);
        return PHASE_PENDING;
    }
    gate_open();
    if (idle == 0)
        r->h.flags |= CUIP_REPLY_NOT_QUIET; /* a synchronize that failed is another reason */
    reply_msg(r, idle < 0 ? CUIP_STATUS_CUDA_FAILED : CUIP_STATUS_REFUSED,
              "QUIESCE: pid %d did not reach a quiet point within %.0f ms%s %s: %s; %s; "
              "the gate is open again and the process runs on",
              (int)getpid(), (double)(deadline - started) / 1e6, moved, stage, why, held);
    shim_log(LOG_WARN, "%.*s", (int)r->h.message_length, r->msg);
    return PHASE_REFUSED;
}
