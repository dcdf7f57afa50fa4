/*
 * Creators: a few threads that run one job per item, in item order, ahead of
 * a consumer that takes the items' results in the same order. LOAD uses it
 * to re-create its allocations (content.c) off the control thread, which
 * queues each one's copy as soon as it exists.
 *
 * Why: on the H200 re-creating one allocation (cuMemCreate, cuMemMap,
 * cuMemSetAccess) took ~62 us on the control thread, 127 ms for 2048
 * allocations of 2 MiB, against ~78 ms to copy their 4 GiB; LOAD ran at 0.52
 * of the HtoD ceiling (docs/benchmarks.md). The driver's VMM calls are
 * thread-safe; how much of their time is serialized inside the driver was
 * not measured, so the number of threads is a setting
 * (SNAPSHOT_SHIM_LOAD_CREATE_THREADS), swept on the H200.
 *
 * The shape: items are claimed in order (so item k starts once items 0..k-1
 * have started, and the consumer, waiting in order, waits least); after the
 * first failure no more are claimed (the ones already running finish), so
 * an op that fails stops as it did when one thread did everything. With no
 * thread (the setting 0, or pthread_create failing) the consumer runs each
 * job itself when it waits for it: the same order and the same results.
 */
#include "shim.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>

struct creators {
    pthread_mutex_t lock;
    pthread_cond_t settled;     /* an item left CREATE_BUSY */
    uint8_t *state;             /* enum create_state per item, under lock */
    uint32_t count, next;       /* next: the first item not claimed yet */
    bool stopped;               /* a job failed, or cancelled: no more claims */
    create_fn *fn;
    void *arg;
    pthread_t *tids;
    unsigned started;
};

/* Under lock: the next item to run, false when none may start. */
static bool claim(struct creators *c, uint32_t *i)
{
    if (c->stopped || c->next == c->count)
        return false;
    *i = c->next++;
    c->state[*i] = CREATE_BUSY;
    return true;
}

/* Run item i's job; called and returns with the lock held. */
static void run_job(struct creators *c, uint32_t i)
{
    int rc;

    pthread_mutex_unlock(&c->lock);
    rc = c->fn(c->arg, i);
    pthread_mutex_lock(&c->lock);
    c->state[i] = rc == 0 ? CREATE_DONE : CREATE_FAILED;
    if (rc != 0)
        c->stopped = true;
    pthread_cond_broadcast(&c->settled);
}

static void *creator_thread(void *arg)
{
    struct creators *c = arg;
    uint32_t i;

    pthread_mutex_lock(&c->lock);
    while (claim(c, &i))
        run_job(c, i);
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

static void creators_free(struct creators *c)
{
    pthread_cond_destroy(&c->settled);
    pthread_mutex_destroy(&c->lock);
    free(c->state);
    free(c->tids);
    free(c);
}

struct creators *creators_start(uint32_t count, unsigned threads, create_fn *fn, void *arg)
{
    struct creators *c = calloc(1, sizeof *c);
    sigset_t all, old;

    if (!c)
        return NULL;
    c->state = calloc(count ? count : 1, 1);
    c->tids = calloc(threads ? threads : 1, sizeof *c->tids);
    if (!c->state || !c->tids || pthread_mutex_init(&c->lock, NULL) != 0) {
        free(c->state);
        free(c->tids);
        free(c);
        return NULL;
    }
    pthread_cond_init(&c->settled, NULL);
    c->count = count;
    c->fn = fn;
    c->arg = arg;
    if (threads > count)
        threads = count;
    /* No signals, like the control thread and the staging workers: the
     * application's handlers run on its own threads. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (; c->started < threads; c->started++) {
        int e = pthread_create(&c->tids[c->started], NULL, creator_thread, c);
        if (e != 0) { /* fewer threads: the claims are shared, so still correct */
            shim_log(LOG_WARN, "pthread_create failed (%s): re-creating with %u threads",
                     strerror(e), c->started);
            break;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return c;
}

unsigned creators_threads(const struct creators *c)
{
    return c->started;
}

enum create_state creators_wait(struct creators *c, uint32_t i)
{
    enum create_state st;
    uint32_t k;

    pthread_mutex_lock(&c->lock);
    /* With no thread the caller runs the jobs, in order, up to its own. */
    while (c->started == 0 && c->state[i] == CREATE_WAITING && claim(c, &k))
        run_job(c, k);
    /* An unclaimed item is claimed unless the pool stopped: threads exit only
     * once every item is claimed or no more may be. */
    while (c->state[i] == CREATE_BUSY || (c->state[i] == CREATE_WAITING && !c->stopped))
        pthread_cond_wait(&c->settled, &c->lock);
    st = (enum create_state)c->state[i];
    pthread_mutex_unlock(&c->lock);
    return st == CREATE_WAITING ? CREATE_SKIPPED : st;
}

void creators_cancel(struct creators *c)
{
    pthread_mutex_lock(&c->lock);
    c->stopped = true;
    pthread_mutex_unlock(&c->lock);
}

void creators_stop(struct creators *c)
{
    creators_cancel(c);
    for (unsigned i = 0; i < c->started; i++)
        pthread_join(c->tids[i], NULL);
    creators_free(c);
}
