/*
 * The gate (specs/quiesce.md): every driver call of the application that
 * launches device work or waits for it passes here. Open, a call costs two
 * atomic adds and a load. QUIESCE closes it in two steps: first threads are
 * held at their next host-synchronizing call while launches flow (so that
 * every collective a rank started can be joined by its peers and the device
 * queues drain), then launches are held too. Held threads wait on a
 * condition variable, never holding g.lock or any lock of the driver; they
 * are let go when the gate opens, and while held they call the watch that
 * control.c registers (so that a gate whose coordinator died reopens).
 *
 * In-flight counting: a caller adds itself to its class's count, then reads
 * the level (both sequentially consistent); the closer stores the level,
 * then reads the counts. Either the caller sees the closed level and backs
 * out, or the closer sees the caller and waits for it to leave.
 */
#include "shim.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define WATCH_PERIOD_MS 200

/* A held thread, on its own stack, listed under gate.mu. */
struct held {
    struct held *next;
    const char *call;
    enum gate_class cls;
    bool pass; /* granted one call by gate_advance, not yet taken */
};

static struct {
    int level;                      /* enum gate_level; atomic */
    unsigned in_flight[GATE_CLASSES]; /* atomic */
    pthread_mutex_t mu;             /* held list, waits */
    pthread_cond_t opened;          /* held threads wait for it */
    pthread_cond_t changed;         /* the closer waits for calls to leave or be held */
    struct held *held;
    unsigned held_count;
    unsigned passes;                /* granted by gate_advance, not yet taken */
    void (*watch)(void);
} gate = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .opened = PTHREAD_COND_INITIALIZER,
    .changed = PTHREAD_COND_INITIALIZER,
};

static bool holds(int level, enum gate_class c)
{
    return c == GATE_SYNC ? level >= GATE_HOLD_SYNC : level >= GATE_HOLD_ALL;
}

static void deadline_in(struct timespec *ts, long ms)
{
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* Wait, unlisted from in-flight, until the gate lets class `c` through or
 * gate_advance grants this thread one call. True: granted, and already
 * counted in flight (under gate.mu, so that a closer that waits for the
 * passes to be taken sees it in flight). */
static bool hold(enum gate_class c, const char *call)
{
    struct held me = {.call = call, .cls = c};
    struct held **p;

    pthread_mutex_lock(&gate.mu);
    me.next = gate.held;
    gate.held = &me;
    gate.held_count++;
    pthread_cond_broadcast(&gate.changed);
    while (!me.pass && holds(__atomic_load_n(&gate.level, __ATOMIC_SEQ_CST), c)) {
        struct timespec ts;
        void (*watch)(void) = gate.watch;

        deadline_in(&ts, WATCH_PERIOD_MS);
        if (pthread_cond_timedwait(&gate.opened, &gate.mu, &ts) == ETIMEDOUT && watch) {
            pthread_mutex_unlock(&gate.mu);
            watch(); /* may open the gate; takes g.lock, so not under gate.mu */
            pthread_mutex_lock(&gate.mu);
        }
    }
    for (p = &gate.held; *p; p = &(*p)->next)
        if (*p == &me) {
            *p = me.next;
            break;
        }
    gate.held_count--;
    if (me.pass) {
        __atomic_add_fetch(&gate.in_flight[c], 1, __ATOMIC_SEQ_CST);
        gate.passes--;
        pthread_cond_broadcast(&gate.changed);
    }
    pthread_mutex_unlock(&gate.mu);
    return me.pass;
}

void gate_enter(enum gate_class c, const char *call)
{
    for (;;) {
        __atomic_add_fetch(&gate.in_flight[c], 1, __ATOMIC_SEQ_CST);
        if (!holds(__atomic_load_n(&gate.level, __ATOMIC_SEQ_CST), c))
            return;
        gate_leave(c);
        if (hold(c, call))
            return;
    }
}

void gate_leave(enum gate_class c)
{
    if (__atomic_sub_fetch(&gate.in_flight[c], 1, __ATOMIC_SEQ_CST) == 0 &&
        __atomic_load_n(&gate.level, __ATOMIC_SEQ_CST) != GATE_OPEN) {
        pthread_mutex_lock(&gate.mu);
        pthread_cond_broadcast(&gate.changed);
        pthread_mutex_unlock(&gate.mu);
    }
}

void gate_close(enum gate_level level)
{
    pthread_mutex_lock(&gate.mu);
    __atomic_store_n(&gate.level, (int)level, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&gate.opened); /* from HOLD_ALL to HOLD_SYNC: launches go */
    pthread_mutex_unlock(&gate.mu);
}

unsigned gate_advance(void)
{
    unsigned granted = 0;

    pthread_mutex_lock(&gate.mu);
    __atomic_store_n(&gate.level, GATE_HOLD_SYNC, __ATOMIC_SEQ_CST);
    for (struct held *h = gate.held; h; h = h->next)
        if (h->cls == GATE_SYNC && !h->pass) {
            h->pass = true;
            granted++;
        }
    gate.passes += granted;
    pthread_cond_broadcast(&gate.opened);
    pthread_mutex_unlock(&gate.mu);
    return granted;
}

unsigned gate_held(void)
{
    unsigned n;

    pthread_mutex_lock(&gate.mu);
    n = gate.held_count;
    pthread_mutex_unlock(&gate.mu);
    return n;
}

void gate_open(void)
{
    pthread_mutex_lock(&gate.mu);
    __atomic_store_n(&gate.level, GATE_OPEN, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&gate.opened);
    pthread_mutex_unlock(&gate.mu);
}

enum gate_level gate_level(void)
{
    return (enum gate_level)__atomic_load_n(&gate.level, __ATOMIC_SEQ_CST);
}

/* Under gate.mu: every granted pass is taken. */
static bool passes_taken(void)
{
    return gate.passes == 0;
}

/* Under gate.mu: no gated call inside the driver, and none about to enter
 * (a granted pass not yet taken). */
static bool calls_out(void)
{
    return __atomic_load_n(&gate.in_flight[GATE_LAUNCH], __ATOMIC_SEQ_CST) == 0 &&
           __atomic_load_n(&gate.in_flight[GATE_SYNC], __ATOMIC_SEQ_CST) == 0 && passes_taken();
}

/* Until `settled()` (asked under gate.mu, woken by `changed`) or the
 * monotonic `deadline_ns`; whether it settled. */
static bool wait_settled(bool (*settled)(void), uint64_t deadline_ns)
{
    bool done;

    pthread_mutex_lock(&gate.mu);
    for (;;) {
        uint64_t now = shim_now_ns();
        struct timespec ts;

        done = settled();
        if (done || now >= deadline_ns)
            break;
        deadline_in(&ts, (long)((deadline_ns - now) / 1000000u) + 1);
        pthread_cond_timedwait(&gate.changed, &gate.mu, &ts);
    }
    pthread_mutex_unlock(&gate.mu);
    return done;
}

bool gate_wait_passes(uint64_t deadline_ns)
{
    return wait_settled(passes_taken, deadline_ns);
}

bool gate_wait_calls(uint64_t deadline_ns)
{
    return wait_settled(calls_out, deadline_ns);
}

size_t gate_describe(char *buf, size_t n)
{
    /* Distinct call names with their counts; a few kinds at most. */
    enum { KINDS = 8 };
    const char *name[KINDS];
    unsigned count[KINDS], kinds = 0, other = 0, launch, sync, held;
    int k;
    size_t len;

    pthread_mutex_lock(&gate.mu);
    held = gate.held_count;
    for (const struct held *h = gate.held; h; h = h->next) {
        unsigned i = 0;
        while (i < kinds && strcmp(name[i], h->call))
            i++;
        if (i < kinds) {
            count[i]++;
        } else if (kinds < KINDS) {
            name[kinds] = h->call;
            count[kinds++] = 1;
        } else {
            other++;
        }
    }
    pthread_mutex_unlock(&gate.mu);
    launch = __atomic_load_n(&gate.in_flight[GATE_LAUNCH], __ATOMIC_SEQ_CST);
    sync = __atomic_load_n(&gate.in_flight[GATE_SYNC], __ATOMIC_SEQ_CST);
    k = snprintf(buf, n, "%u thread%s held at the gate", held, held == 1 ? "" : "s");
    for (unsigned i = 0; i < kinds && k >= 0 && (size_t)k < n; i++)
        k += snprintf(buf + k, n - (size_t)k, "%s%s x%u", i ? ", " : " (", name[i], count[i]);
    if (kinds && k >= 0 && (size_t)k < n)
        k += snprintf(buf + k, n - (size_t)k, "%s)", other ? ", ..." : "");
    if (k >= 0 && (size_t)k < n)
        k += snprintf(buf + k, n - (size_t)k,
                      "; %u synchronizing and %u launching call%s still inside the driver", sync,
                      launch, launch == 1 ? "" : "s");
    len = k < 0 ? 0 : (size_t)k;
    return len < n ? len : (n ? n - 1 : 0);
}

void gate_set_watch(void (*watch)(void))
{
    pthread_mutex_lock(&gate.mu);
    gate.watch = watch;
    pthread_mutex_unlock(&gate.mu);
}

void gate_after_fork(void)
{
    /* Only the forking thread survives: nobody is held or in flight. The
     * child is a new process, never quiesced. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cv = PTHREAD_COND_INITIALIZER;

    memcpy(&gate.mu, &fresh, sizeof fresh);
    memcpy(&gate.opened, &fresh_cv, sizeof fresh_cv);
    memcpy(&gate.changed, &fresh_cv, sizeof fresh_cv);
    gate.level = GATE_OPEN;
    gate.in_flight[GATE_LAUNCH] = gate.in_flight[GATE_SYNC] = 0;
    gate.held = NULL;
    gate.held_count = 0;
    gate.passes = 0;
}
