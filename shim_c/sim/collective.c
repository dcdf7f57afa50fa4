/* A cross-process collective for tests of QUIESCE (specs/quiesce.md).
 *
 * An NCCL kernel keeps its stream busy until every rank has launched its
 * part: a rank whose gate holds it before that launch leaves its peers'
 * streams busy for good. cuinterposeSimCollective is a CUhostFn a test
 * launches with cuLaunchHostFunc (through the shim's gate, as any launch) to
 * play that part on the simulator: rank r counts its arrivals in a word of
 * memory every rank maps (a MAP_SHARED file), then waits until every rank's
 * count has reached its own. The abandon word lets a test end ranks that
 * will never meet again. */
#include "sim.h"

#include <time.h>

void cuinterposeSimCollective(void *arg)
{
    const struct cuinterpose_sim_collective *c = arg;
    uint64_t mine = __atomic_add_fetch(&c->arrived[c->rank], 1, __ATOMIC_SEQ_CST);
    const struct timespec pause = {.tv_nsec = 100000};

    for (uint32_t r = 0; r < c->ranks; r++)
        while (__atomic_load_n(&c->arrived[r], __ATOMIC_SEQ_CST) < mine &&
               !__atomic_load_n(c->abandon, __ATOMIC_SEQ_CST))
            nanosleep(&pause, NULL);
}
