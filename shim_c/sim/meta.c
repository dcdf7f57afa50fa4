/* The metadata page: the last page of every memfd (allocation or multicast
 * object), shared by every process that holds the memfd. Its creation, its
 * robust process-shared lock, and the multicast team it holds (devices
 * added, bindings) live here so that vmm.c (which creates allocations and
 * drops the last reference to any object) and multicast.c (which builds
 * teams) both build on it without needing each other. */
#include "sim.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
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

/* ---- the multicast data path -------------------------------------------
 * A write through a multicast mapping reaches every member bound at those
 * offsets. A member is named by the binding process's memfd number and its
 * inode, opened through /proc (same user); one whose process or memory is
 * gone is skipped, as a device that left the team. Copies and memsets call
 * this after writing (copy.c), with sim.mu held. */

/* The bound member's memfd, opened through the binding process; -1 when
 * that process or that memory is gone. */
int sim_peer_fd_open(int32_t pid, int32_t peer_fd, uint64_t ino, uint64_t dev)
{
    char path[64];
    struct stat st;
    int fd;

    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, (int)peer_fd);
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -1;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_ino != ino || (uint64_t)st.st_dev != dev) {
        close(fd);
        return -1;
    }
    return fd;
}

static int member_open(const struct sim_bind *b)
{
    return sim_peer_fd_open(b->pid, b->mem_fd, b->mem_ino, b->mem_dev);
}

/* [off, off + n) of `mc`, whose bytes are at `src`, to every member bound
 * over it. */
static CUresult mirror_object(struct sim_obj *mc, uint64_t off, const uint8_t *src, size_t n)
{
    struct sim_bind binds[SIM_MC_MAX_BINDS];
    uint32_t nb;
    CUresult r = CUDA_SUCCESS;

    if (sim_meta_lock(mc->meta) != 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    nb = mc->meta->nbinds;
    memcpy(binds, mc->meta->binds, nb * sizeof binds[0]);
    sim_meta_unlock(mc->meta);
    for (uint32_t i = 0; i < nb; i++) {
        const struct sim_bind *b = &binds[i];
        uint64_t lo = off > b->offset ? off : b->offset;
        uint64_t hi = off + n < b->offset + b->size ? off + n : b->offset + b->size;
        size_t len;
        ssize_t k;
        int fd;

        if (lo >= hi)
            continue;
        fd = member_open(b);
        if (fd < 0)
            continue;
        len = (size_t)(hi - lo);
        k = pwrite(fd, src + (lo - off), len, (off_t)(b->mem_offset + (lo - b->offset)));
        close(fd);
        if (k != (ssize_t)len)
            r = CUDA_ERROR_OPERATING_SYSTEM;
    }
    return r;
}

CUresult sim_mc_mirror(uintptr_t va, size_t n)
{
    CUresult r = CUDA_SUCCESS;

    for (int i = 0; i < SIM_MAX_MAPS; i++) {
        const struct sim_map *m = &sim.maps[i];
        struct sim_obj *o;
        uintptr_t lo, hi;

        if (!m->used || m->taken || !(m->va < va + n && va < m->va + m->size))
            continue;
        o = &sim.objs[m->obj];
        if (o->kind != SIM_KIND_MULTICAST || !o->meta)
            continue;
        lo = va > m->va ? va : m->va;
        hi = va + n < m->va + m->size ? va + n : m->va + m->size;
        if (mirror_object(o, m->offset + (lo - m->va), (const uint8_t *)lo, hi - lo) !=
            CUDA_SUCCESS)
            r = CUDA_ERROR_OPERATING_SYSTEM;
    }
    return r;
}
