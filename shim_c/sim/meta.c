/* The metadata page: the last page of every memfd (allocation or multicast
 * object), shared by every process that holds the memfd. Its creation, its
 * robust process-shared lock, and the multicast team it holds (devices
 * added, bindings) live here so that vmm.c (which creates allocations and
 * drops the last reference to any object) and multicast.c (which builds
 * teams) both build on it without needing each other. */
#include "sim.h"

#include <errno.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* A memfd of `size` data bytes and its metadata page, mapped here with the
 * page's lock ready; the caller fills in what kind of object it is. */
CUresult sim_memfd_new(const char *name, uint64_t size, int *fd_out, struct sim_meta **meta_out)
{
    struct sim_meta *meta;
    int fd;

    fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)(size + SIM_META_SIZE)) != 0)
        goto fail;
    meta = mmap(NULL, SIM_META_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)size);
    if (meta == MAP_FAILED)
        goto fail;
    if (sim_meta_init_lock(meta) != CUDA_SUCCESS) {
        munmap(meta, SIM_META_SIZE);
        goto fail;
    }
    meta->magic = SIM_META_MAGIC;
    meta->size = size;
    meta->creator_pid = (int32_t)getpid();
    *fd_out = fd;
    *meta_out = meta;
    return CUDA_SUCCESS;
fail:
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult sim_meta_init_lock(struct sim_meta *m)
{
    pthread_mutexattr_t a;
    int e;

    if (pthread_mutexattr_init(&a) != 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    e = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    if (e == 0)
        e = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    if (e == 0)
        e = pthread_mutex_init(&m->lock, &a);
    pthread_mutexattr_destroy(&a);
    return e == 0 ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM;
}

int sim_meta_lock(struct sim_meta *m)
{
    int e = pthread_mutex_lock(&m->lock);

    /* A team member died holding the lock: the team data is plain
     * counters written under it, consistent at every store. */
    if (e == EOWNERDEAD) {
        pthread_mutex_consistent(&m->lock);
        e = 0;
    }
    return e;
}

void sim_meta_unlock(struct sim_meta *m)
{
    pthread_mutex_unlock(&m->lock);
}

/* ---- the multicast team ----------------------------------------------- */

static int team_complete(struct sim_meta *m)
{
    int done = 0;

    if (sim_meta_lock(m) == 0) {
        done = m->added_count >= m->num_devices;
        sim_meta_unlock(m);
    }
    return done;
}

/* Called without sim.mu: the devices are added by other processes (or
 * other threads of this one). */
CUresult sim_mc_wait_complete(struct sim_obj *mc)
{
    long cap_ms = sim_env_long("CUINTERPOSE_SIM_MC_WAIT_MS", 20000, 1, 3600L * 1000);
    double deadline = sim_now_ms() + (double)cap_ms;
    struct timespec nap = {0, 1000 * 1000};

    while (!team_complete(mc->meta)) {
        if (sim_now_ms() >= deadline)
            return CUDA_ERROR_TIMEOUT;
        nanosleep(&nap, NULL);
    }
    return CUDA_SUCCESS;
}

/* Our bindings end with our last reference to the object. */
void sim_mc_drop_binds(struct sim_obj *mc)
{
    struct sim_meta *m = mc->meta;
    int32_t me = (int32_t)getpid();
    uint32_t j = 0;

    if (sim_meta_lock(m) != 0)
        return;
    for (uint32_t i = 0; i < m->nbinds; i++)
        if (m->binds[i].pid != me)
            m->binds[j++] = m->binds[i];
    m->nbinds = j;
    sim_meta_unlock(m);
}
