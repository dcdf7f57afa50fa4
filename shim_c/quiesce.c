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

/* ------------------------------------------------------------ contexts */
static bool ctx_set_add(struct ctx_set *s, CUcontext ctx, int primary_of)
{
    for (uint32_t k = 0; k < s->n; k++)
        if (s->ctx[k] == ctx)
            return true;
    if (s->n == s->cap) {
        uint32_t cap = s->cap ? 2 * s->cap : 8;
        CUcontext *c = realloc(s->ctx, cap * sizeof *c);
        int *p;

        if (!c)
            return false;
        s->ctx = c;
        p = realloc(s->primary_of, cap * sizeof *p);
        if (!p)
            return false;
        s->primary_of = p;
        s->cap = cap;
    }
    s->primary_of[s->n] = primary_of;
    s->ctx[s->n++] = ctx;
    return true;
}

void ctx_set_free(struct ctx_set *s)
{
    for (uint32_t k = 0; k < s->n; k++)
        if (s->primary_of[k] >= 0)
            real.cuDevicePrimaryCtxRelease(s->primary_of[k]);
    free(s->ctx);
    free(s->primary_of);
    memset(s, 0, sizeof *s);
}

/* Every active primary context (the runtime's), retained while in `s`. */
static bool add_primaries(struct ctx_set *s)
{
    int devices = 0;

    if (!real.cuDeviceGetCount || !real.cuDevicePrimaryCtxGetState ||
        !real.cuDevicePrimaryCtxRetain || !real.cuDevicePrimaryCtxRelease ||
        real.cuDeviceGetCount(&devices) != CUDA_SUCCESS)
        return true;
    for (int d = 0; d < devices; d++) {
        unsigned flags;
        int active = 0;
        CUcontext ctx;
        uint32_t before = s->n;

        if (real.cuDevicePrimaryCtxGetState(d, &flags, &active) != CUDA_SUCCESS || !active ||
            real.cuDevicePrimaryCtxRetain(&ctx, d) != CUDA_SUCCESS)
            continue;
        if (!ctx_set_add(s, ctx, d)) {
            real.cuDevicePrimaryCtxRelease(d);
            return false;
        }
        if (s->n == before)
            real.cuDevicePrimaryCtxRelease(d); /* known already */
    }
    return true;
}

int ctx_set_collect(struct ctx_set *s, char *msg, size_t n)
{
    bool fits = true;

    memset(s, 0, sizeof *s);
    pthread_mutex_lock(&g.lock);
    for (uint32_t i = 0; i < obj_count() && fits; i++) {
        const struct obj *o = obj_at(i);
        if (o && o->ctx)
            fits = ctx_set_add(s, o->ctx, -1);
    }
    pthread_mutex_unlock(&g.lock);
    if (fits)
        fits = add_primaries(s);
    if (!fits) {
        snprintf(msg, n, "out of memory collecting the contexts");
        ctx_set_free(s);
        return -1;
    }
    return 0;
}

CUresult ctx_set_sync(const struct ctx_set *s, uint32_t *failed, const char **call)
{
    CUresult rc = CUDA_SUCCESS;

    for (uint32_t k = 0; k < s->n && rc == CUDA_SUCCESS; k++) {
        bool pushed;

        *call = "cuCtxPushCurrent";
        rc = shim_ctx_enter(s->ctx[k], &pushed);
        if (rc == CUDA_SUCCESS) {
            *call = "cuCtxSynchronize";
            rc = real.cuCtxSynchronize();
            shim_ctx_leave(pushed);
        }
        if (rc != CUDA_SUCCESS)
            *failed = k;
    }
    return rc;
}

/* ------------------------------------------------------------ idleness */
/* One look at whether every context is idle; shared by the control thread
 * and the helper, freed by whichever lets go of it last. */
struct idle_check {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool done;
    CUresult rc;
    uint32_t failed;                 /* the context whose call failed */
    const char *call;                /* that call */
    struct ctx_set set;
};

static void idle_check_put(struct idle_check *c)
{
    bool last;

    pthread_mutex_lock(&c->mu);
    last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) {
        ctx_set_free(&c->set);
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->cv);
        free(c);
    }
}

static void *idle_main(void *arg)
{
    struct idle_check *c = arg;
    uint32_t failed = 0;
    const char *call = NULL;
    CUresult rc = ctx_set_sync(&c->set, &failed, &call);

    pthread_mutex_lock(&c->mu);
    c->done = true;
    c->rc = rc;
    c->failed = failed;
    c->call = call;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    idle_check_put(c);
    return NULL;
}

/* Until the helper is done or `deadline_ns`, with c->mu held. */
static void wait_done(struct idle_check *c, uint64_t deadline_ns)
{
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
}

/* 1: every context idle; 0: not by `deadline_ns` (msg says what); -1: a
 * synchronize failed or nothing could be asked (msg). The primary contexts
 * the set retained are released with it, by whichever side lets go last. */
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
    if (!real.cuCtxSynchronize) {
        snprintf(msg, n, "the driver has no cuCtxSynchronize");
        free(c);
        return -1;
    }
    if (ctx_set_collect(&c->set, msg, n) != 0) {
        free(c);
        return -1;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->refs = 2;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&t, &at, idle_main, c);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        snprintf(msg, n, "cannot start a thread: %s", strerror(rc));
        c->refs = 1;
        idle_check_put(c);
        return -1;
    }
    pthread_mutex_lock(&c->mu);
    wait_done(c, deadline_ns);
    if (!c->done) {
        rc = 0;
        snprintf(msg, n, "device work still running in %u context%s", c->set.n,
                 c->set.n == 1 ? "" : "s");
    } else if (c->rc != CUDA_SUCCESS) {
        rc = -1;
        snprintf(msg, n, "context %u of %u: %s failed: %s", c->failed + 1, c->set.n, c->call,
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

/* SNAPSHOT_SHIM_GATE=0: the device drained once, nothing held. */
static enum phase_result quiesce_ungated(uint64_t asked, uint64_t own, struct reply *r)
{
    uint64_t now = shim_now_ns();
    uint64_t deadline = now + (asked && asked < own ? asked : own);
    char why[160];
    int idle = device_idle(deadline, why, sizeof why);

    if (idle == 1)
        return PHASE_DONE;
    reply_msg(r, idle < 0 ? CUIP_STATUS_CUDA_FAILED : CUIP_STATUS_REFUSED,
              "QUIESCE: pid %d (gate off) did not drain within %.0f ms: %s", (int)getpid(),
              (double)(deadline - now) / 1e6, why);
    return PHASE_REFUSED;
}

/* An open gate starts a capture's quiescing (closed for synchronizing
 * calls, the start time recorded); a closed one is a later round: still
 * closing (ACTIVE), or an advance (control.c made a QUIESCED process ACTIVE
 * for it). The start of this capture's quiescing. */
static uint64_t quiesce_start(uint64_t now, uint64_t started)
{
    if (gate_level() != GATE_OPEN)
        return started;
    pthread_mutex_lock(&g.lock);
    g.quiesce_started_ns = now;
    g.quiesce_advances = 0;
    pthread_mutex_unlock(&g.lock);
    gate_close(GATE_HOLD_SYNC);
    return now;
}

/* An advance: the threads held at a synchronizing call take it, once. 1 when
 * they did by `deadline`, else 0 and why. */
static int quiesce_advance(uint64_t deadline, unsigned *granted, char *why, size_t n)
{
    pthread_mutex_lock(&g.lock);
    g.quiesce_advances++;
    pthread_mutex_unlock(&g.lock);
    *granted = gate_advance();
    if (gate_wait_passes(deadline))
        return 1;
    snprintf(why, n, "threads granted a call did not take it");
    return 0;
}

/* Not quiet (`idle` 0) or a synchronize failed (-1): PENDING for a round
 * with time left (the gate stays closed), else refused with the gate open. */
static enum phase_result quiesce_not_quiet(int idle, bool round, uint64_t started,
                                           uint64_t limit, uint64_t deadline, const char *stage,
                                           const char *why, struct reply *r)
{
    char held[600], moved[48] = "";
    unsigned advances;

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
                  /* No pid: the coordinator names the process, by both of its pids. */
                  "QUIESCE: not quiet yet after %.0f ms%s %s: %s; %s; the gate stays "
                  "closed until the next round",
                  (double)(shim_now_ns() - started) / 1e6, moved, stage, why,
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

enum phase_result quiesce_run(struct reply *r)
{
    uint64_t own = ms_to_ns((uint64_t)shim_settings()->quiesce_timeout_ms);
    uint64_t asked, now, started, limit, deadline;
    const char *stage = "with synchronizing calls held and launches flowing";
    unsigned granted = 0;
    bool round, advance;
    char why[160];
    int idle = 1;

    pthread_mutex_lock(&g.lock);
    asked = g.quiesce_deadline_ns;
    round = g.quiesce_round;
    started = g.quiesce_started_ns;
    pthread_mutex_unlock(&g.lock);
    if (!shim_settings()->gate)
        return quiesce_ungated(asked, own, r);
    now = shim_now_ns();
    advance = gate_level() == GATE_HOLD_ALL;
    started = quiesce_start(now, started);
    limit = started + own;
    deadline = asked && now + asked < limit ? now + asked : limit;
    if (advance)
        idle = quiesce_advance(deadline, &granted, why, sizeof why);
    if (idle == 1)
        idle = quiet_by(deadline, &stage, why, sizeof why);
    if (idle != 1)
        return quiesce_not_quiet(idle, round, started, limit, deadline, stage, why, r);
    cuip_set_quiesce_held(&r->h, gate_held());
    shim_log(LOG_INFO, "quiet after %.1f ms (%u thread%s held; this advance granted %u "
             "synchronizing calls)", (double)(shim_now_ns() - started) / 1e6,
             (unsigned)cuip_quiesce_held(&r->h), cuip_quiesce_held(&r->h) == 1 ? "" : "s",
             granted);
    return PHASE_DONE;
}
