/* The driver's single state struct, the checkpoint gate every API call goes
 * through, environment parsing, and the device-wide memory accounting. */
#include "sim.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct sim_state sim = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .gate_mu = PTHREAD_MUTEX_INITIALIZER,
    .gate_cv = PTHREAD_COND_INITIALIZER,
    .init_once = PTHREAD_ONCE_INIT,
    .init_result = CUDA_ERROR_NOT_INITIALIZED,
    .ck_state = CU_PROCESS_STATE_RUNNING,
    .service_fd = -1,
};

void sim_lock(void)
{
    pthread_mutex_lock(&sim.mu);
}

void sim_unlock(void)
{
    pthread_mutex_unlock(&sim.mu);
}

/* A locked process blocks its own driver calls until the controller
 * unlocks it; a lock in progress also holds new calls back so that the
 * calls in flight can drain. */
CUresult sim_enter(void)
{
    if (!sim.initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&sim.gate_mu);
    while (sim.ck_state != CU_PROCESS_STATE_RUNNING || sim.lock_pending)
        pthread_cond_wait(&sim.gate_cv, &sim.gate_mu);
    sim.in_flight++;
    pthread_mutex_unlock(&sim.gate_mu);
    return CUDA_SUCCESS;
}

void sim_leave(void)
{
    pthread_mutex_lock(&sim.gate_mu);
    sim.in_flight--;
    pthread_cond_broadcast(&sim.gate_cv);
    pthread_mutex_unlock(&sim.gate_mu);
}

/* Value of an integer variable, `def` when unset or malformed: a typo in a
 * test's environment must not silently mean zero. */
/* FNV-1a of the node's name: "" (no node) is 0, today's UUIDs. */
uint64_t sim_env_node(void)
{
    const char *s = getenv("CUINTERPOSE_SIM_NODE");
    uint64_t h = 0xcbf29ce484222325ull;

    if (!s || !*s)
        return 0;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h ? h : 1;
}

void sim_gpu_uuid(uint64_t node, int gpu, char bytes[16])
{
    static const char tag[] = "cuipsim";

    memset(bytes, 0, 16);
    memcpy(bytes, tag, sizeof(tag) - 1);
    for (int i = 0; i < 8; i++)
        bytes[7 + i] = (char)(node >> (8 * i));
    bytes[15] = (char)gpu;
}

void sim_env_chip(char *out, size_t n)
{
    const char *c = getenv("CUINTERPOSE_SIM_CHIP");

    if (c && *c)
        snprintf(out, n, "%s %s", SIM_DEVICE_NAME, c);
    else
        snprintf(out, n, "%s", SIM_DEVICE_NAME);
}

long sim_env_long(const char *name, long def, long lo, long hi)
{
    const char *s = getenv(name);
    char *end = NULL;
    long v;

    if (!s || !*s)
        return def;
    errno = 0;
    v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) {
        fprintf(stderr, "cuinterpose-sim: ignoring %s=%s (want %ld..%ld)\n", name, s, lo, hi);
        return def;
    }
    return v;
}

double sim_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int sim_is_aligned(uint64_t v, uint64_t a)
{
    return (v % a) == 0;
}

/* ---- device-wide accounting ------------------------------------------ */

int sim_pid_alive(int pid)
{
    return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

/* Map /dev/shm/cuinterpose-sim-<uid>-<namespace> (namespace from
 * CUINTERPOSE_SIM_NAMESPACE, so concurrent test runs do not see each
 * other's memory) and claim a slot. Failure only disables the device-wide
 * view: cuMemGetInfo then counts this process alone. */
void sim_acct_init(void)
{
    const char *ns = getenv("CUINTERPOSE_SIM_NAMESPACE");
    char path[PATH_MAX];
    struct sim_acct *a = NULL;
    int fd = -1, i, me = (int)getpid();

    if (!ns || !*ns || strchr(ns, '/'))
        ns = "default";
    if (snprintf(path, sizeof(path), "/dev/shm/cuinterpose-sim-%u-%s", (unsigned)getuid(), ns) >=
        (int)sizeof(path))
        goto fail;
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        goto fail;
    /* Every process truncates to the same size: idempotent, and a new
     * file reads as zeros (no slot claimed). */
    if (ftruncate(fd, sizeof(struct sim_acct)) != 0)
        goto fail;
    a = mmap(NULL, sizeof(*a), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (a == MAP_FAILED) {
        a = NULL;
        goto fail;
    }
    close(fd);
    fd = -1;
    for (i = 0; i < SIM_ACCT_SLOTS; i++) {
        struct sim_acct_slot *s = &a->slot[i];
        int old = atomic_load(&s->pid);

        if (old == me || (old != 0 && sim_pid_alive(old)))
            continue;
        if (!atomic_compare_exchange_strong(&s->pid, &old, me))
            continue;
        for (int d = 0; d < SIM_MAX_DEVICES; d++)
            atomic_store(&s->used[d], 0);
        sim.acct = a;
        sim.my_slot = s;
        return;
    }
fail:
    if (a)
        munmap(a, sizeof(*a));
    if (fd >= 0)
        close(fd);
    fprintf(stderr, "cuinterpose-sim: device-wide memory accounting unavailable\n");
}



void sim_acct_add(int dev, long long delta)
{
    if (dev < 0 || dev >= SIM_MAX_DEVICES)
        return;
    if (sim.my_slot)
        atomic_fetch_add(&sim.my_slot->used[dev], (unsigned long long)delta);
    else
        sim.local_used[dev] += (unsigned long long)delta;
}

unsigned long long sim_acct_used(int dev)
{
    unsigned long long sum = 0;

    if (!sim.acct)
        return sim.local_used[dev];
    for (int i = 0; i < SIM_ACCT_SLOTS; i++) {
        struct sim_acct_slot *s = &sim.acct->slot[i];
        int pid = atomic_load(&s->pid);

        if (pid != 0 && sim_pid_alive(pid))
            sum += atomic_load(&s->used[dev]);
    }
    return sum;
}

void sim_fault_arm(struct sim_fault *f, unsigned skip, CUresult result)
{
    sim_lock();
    f->skip = skip;
    f->result = result;
    sim_unlock();
}

CUresult sim_fault_due(struct sim_fault *f)
{
    CUresult r = CUDA_SUCCESS;

    sim_lock();
    if (f->result != CUDA_SUCCESS && f->skip-- == 0) {
        r = f->result;
        f->result = CUDA_SUCCESS;
    }
    sim_unlock();
    return r;
}
