/* Checkpoint API: the controller's calls and the per-process service.
 *
 * cuInit starts a thread listening on the abstract Unix socket
 * "cuinterpose-sim-ckpt-<pid namespace inode>-<pid in it>"; a controller's
 * cuCheckpointProcess*(pid) names the process by its pid in the
 * controller's own pid namespace (a pod's process by its host pid, as the
 * real driver takes it), finds that process's pid namespace and its pid
 * there in /proc/<pid>, and connects to that name, from the process's
 * network namespace when it has another one. Two pods whose processes
 * have the same namespace pid and share a network namespace so never
 * collide. The service drives this process's state machine:
 *
 *   RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED
 *   CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING
 *
 * Any other transition is CUDA_ERROR_ILLEGAL_STATE. A lock that cannot
 * drain the calls in flight within its timeout returns CUDA_ERROR_NOT_READY
 * and leaves the process RUNNING (the driver documents both).
 *
 * Owned memory is every allocation this process created (cuMemCreate,
 * cuMemAlloc). Checkpoint copies each aside, makes every mapped VA
 * inaccessible, and drops the process's references (its memfds): memory
 * nobody else holds is freed; memory an exported FD or another process's
 * import still holds lives on there, detached. Restore gives each owned
 * allocation new memory with the saved bytes at the same VAs under the same
 * handle; an FD exported before the checkpoint still names the old memory.
 * All of this is what the real driver was measured to do (an H200 with
 * driver 580: free memory during the checkpoint, bytes behind an old FD).
 * Imports from other processes are dropped too and are not owned: restore
 * refuses with CUDA_ERROR_NOT_SUPPORTED (then OPERATING_SYSTEM on every
 * later attempt), leaving the process CHECKPOINTED, as measured; a process
 * holding a multicast object is refused the same way. */
#include "sim.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#define CK_MAGIC 0x4b435343u /* "CSCK" */

enum ck_op { CK_LOCK = 1, CK_CHECKPOINT, CK_RESTORE, CK_UNLOCK, CK_STATE, CK_TID };

struct ck_pair {
    char old_uuid[16];
    char new_uuid[16];
};

/* CK_RESTORE carries the controller's node, its chip and memory (the GPUs a
 * restore lands on are the controller's: a process CRIU brought to another
 * node restores onto that node's GPUs) and the gpuPairs. */
struct ck_req {
    uint32_t magic;
    uint32_t op;
    uint32_t timeout_ms;
    uint32_t npairs;
    uint64_t node;
    uint64_t mem_total;
    char chip[64];
    struct ck_pair pairs[SIM_MAX_DEVICES];
};

struct ck_rep {
    int32_t result;
    int32_t state;
    int32_t tid;
    int32_t pad;
};

/* The service's name: the process's pid namespace (its nsfs inode) and its
 * pid there, which no other process on the machine shares. */
static socklen_t ck_addr(struct sockaddr_un *a, unsigned long long pidns, int nspid)
{
    int n;

    memset(a, 0, sizeof(*a));
    a->sun_family = AF_UNIX;
    /* Abstract name: nothing to clean up when the process dies. */
    n = snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1, "cuinterpose-sim-ckpt-%llu-%d", pidns,
                 nspid);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* The inode of /proc/<who>/ns/<kind>; 0 where it cannot be read (no /proc in
 * a pod's root: its service is then reached by no controller). */
static unsigned long long ns_inode(const char *who, const char *kind)
{
    char path[64];
    struct stat st;

    snprintf(path, sizeof path, "/proc/%s/ns/%s", who, kind);
    return stat(path, &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

/* The last field of the NSpid line of a status file (/proc/<pid>/status, or
 * a thread's /proc/<pid>/task/<tid>/status): the pid or tid in the innermost
 * pid namespace; -1 where there is none. */
static int innermost_of(const char *path)
{
    char line[256];
    int found = -1;
    FILE *f;

    f = fopen(path, "re");
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f)) {
        char *p = line + 6, *end;

        if (strncmp(line, "NSpid:", 6) != 0)
            continue;
        for (;;) {
            long v = strtol(p, &end, 10);

            if (end == p)
                break;
            found = v > 0 && v <= INT32_MAX ? (int)v : -1;
            p = end;
        }
        break;
    }
    fclose(f);
    return found;
}

/* Process pid's own pid in its innermost pid namespace. */
static int innermost_pid(int pid)
{
    char path[64];

    snprintf(path, sizeof path, "/proc/%d/status", pid);
    return innermost_of(path);
}

/* The thread of process pid whose tid in the process's own pid namespace is
 * ns_tid, as this process numbers it: the real driver gives a restore thread's
 * id in the caller's numbering, the host's for an agent outside a pod
 * (specs/records/2026-12-07-h100-pid-namespace.jsonl); -1 where no thread of
 * pid has it (gone since). */
static int tid_seen_here(int pid, int ns_tid)
{
    char path[96];
    struct dirent *e;
    int found = -1;
    DIR *d;

    snprintf(path, sizeof path, "/proc/%d/task", pid);
    d = opendir(path);
    if (!d)
        return -1;
    while (found < 0 && (e = readdir(d))) {
        char *end;
        long tid = strtol(e->d_name, &end, 10);

        if (end == e->d_name || *end || tid <= 0 || tid > INT32_MAX)
            continue;
        snprintf(path, sizeof path, "/proc/%d/task/%ld/status", pid, tid);
        if (innermost_of(path) == ns_tid)
            found = (int)tid;
    }
    closedir(d);
    return found;
}

/* A socket of process pid's network namespace: the controller's own when
 * they share one, or when the process's cannot be entered (not ours to look
 * at: then its service is out of reach, and the connect says so); else made
 * there by this thread alone (setns of a network namespace moves only the
 * calling thread, and back it goes at once). */
static int socket_in_net_of(int pid)
{
    char who[16], path[64];
    unsigned long long theirs;
    int self = -1, there = -1, fd = -1;

    snprintf(who, sizeof who, "%d", pid);
    theirs = ns_inode(who, "net");
    if (theirs == 0 || theirs == ns_inode("thread-self", "net"))
        return socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    snprintf(path, sizeof path, "/proc/%d/ns/net", pid);
    there = open(path, O_RDONLY | O_CLOEXEC);
    self = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    if (there < 0 || self < 0 || setns(there, CLONE_NEWNET) != 0) {
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        goto out;
    }
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (setns(self, CLONE_NEWNET) != 0) { /* not back home: this thread must not go on */
        if (fd >= 0)
            close(fd);
        abort();
    }
out:
    if (there >= 0)
        close(there);
    if (self >= 0)
        close(self);
    return fd;
}

/* ---- the target's side (sim.mu held for the memory work) -------------- */

/* Why the restore of this process fails, or CUDA_SUCCESS: it holds memory
 * of another process or a multicast object, as observed on the real driver
 * for imports. A legacy IPC import (cuIpcOpenMemHandle) was seen to fail
 * with CUDA_ERROR_INVALID_VALUE, a VMM import with NOT_SUPPORTED once, then
 * OPERATING_SYSTEM on every later attempt. */
static CUresult restore_refusal(void)
{
    int ipc = 0, other = 0;

    for (int i = 0; i < SIM_MAX_OBJS; i++) {
        const struct sim_obj *o = &sim.objs[i];

        if (!o->used)
            continue;
        if (o->foreign && o->origin == SIM_FROM_IPC)
            ipc = 1;
        else if (o->foreign || o->kind == SIM_KIND_MULTICAST)
            other = 1;
    }
    if (ipc)
        return CUDA_ERROR_INVALID_VALUE;
    if (other)
        return sim.restore_refused++ ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_ERROR_NOT_SUPPORTED;
    return CUDA_SUCCESS;
}

static int io_all(int fd, void *buf, size_t n, int write_it)
{
    size_t done = 0;

    while (done < n) {
        ssize_t k = write_it ? pwrite(fd, (char *)buf + done, n - done, (off_t)done)
                             : pread(fd, (char *)buf + done, n - done, (off_t)done);

        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        done += (size_t)k;
    }
    return 0;
}

static int owned(const struct sim_obj *o)
{
    return o->used && o->kind == SIM_KIND_ALLOC && !o->imported;
}

/* Phase 1 of a checkpoint, undoable: copy every owned allocation aside. */
static CUresult save_owned(void)
{
    for (int i = 0; i < SIM_MAX_OBJS; i++) {
        struct sim_obj *o = &sim.objs[i];
        void *p;

        if (!owned(o) || o->saved)
            continue;
        p = mmap(NULL, o->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return CUDA_ERROR_OUT_OF_MEMORY;
        o->saved = p;
        if (io_all(o->fd, p, o->size, 0) != 0)
            return CUDA_ERROR_OPERATING_SYSTEM;
    }
    return CUDA_SUCCESS;
}

static void discard_saved(void)
{
    for (int i = 0; i < SIM_MAX_OBJS; i++) {
        struct sim_obj *o = &sim.objs[i];

        if (o->used && o->saved && !o->released) {
            munmap(o->saved, o->size);
            o->saved = NULL;
        }
    }
}

/* This process lets go of the memory: what it owned is freed unless some
 * other reference (an exported FD, another process's import) keeps it, in
 * which case that memory lives on there, detached from this process, as
 * on the real driver. Its own imports from other processes go too. */
static void drop_reference(struct sim_obj *o)
{
    if (!o->used || o->released || o->kind != SIM_KIND_ALLOC || (o->imported && !o->foreign))
        return;
    munmap(o->meta, SIM_META_SIZE);
    close(o->fd);
    o->meta = NULL;
    o->fd = -1;
    o->released = 1;
    if (!o->imported)
        sim_acct_add(o->props.loc_id, -(long long)o->size);
}

static CUresult restore_memory(void);

static CUresult checkpoint_memory(void)
{
    CUresult r = save_owned();

    if (r != CUDA_SUCCESS) {
        discard_saved(); /* nothing was taken: still LOCKED as before */
        return r;
    }
    /* Every mapped VA becomes inaccessible reserved space. Replacing our
     * own reservation's pages does not fail but for lack of kernel memory. */
    for (int i = 0; i < SIM_MAX_MAPS; i++) {
        struct sim_map *m = &sim.maps[i];

        if (!m->used || m->taken)
            continue;
        if (mmap((void *)m->va, m->size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
            restore_memory(); /* nothing dropped yet: map back, still LOCKED */
            discard_saved();
            return CUDA_ERROR_OPERATING_SYSTEM;
        }
        m->taken = 1;
    }
    for (int i = 0; i < SIM_MAX_OBJS; i++)
        drop_reference(&sim.objs[i]);
    return CUDA_SUCCESS;
}

/* Restore gives each owned allocation new memory holding its saved bytes,
 * under the same handle. An FD exported before the checkpoint still names
 * the old memory (measured on the real driver). */
static CUresult recreate(struct sim_obj *o)
{
    struct sim_meta *meta;
    int fd;
    CUresult r;

    if (!o->used || !o->released || o->imported)
        return CUDA_SUCCESS;
    r = sim_alloc_memfd(o->size, &o->props, &fd, &meta);
    if (r != CUDA_SUCCESS)
        return r;
    meta->alloc_id = o->id;
    if (io_all(fd, o->saved, o->size, 1) != 0) {
        munmap(meta, SIM_META_SIZE);
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    munmap(o->saved, o->size);
    o->saved = NULL;
    o->fd = fd;
    o->meta = meta;
    o->released = 0;
    sim_acct_add(o->props.loc_id, (long long)o->size);
    return CUDA_SUCCESS;
}

static CUresult remap(struct sim_map *m)
{
    struct sim_obj *o = &sim.objs[m->obj];
    void *p;

    if (!m->taken)
        return CUDA_SUCCESS;
    p = mmap((void *)m->va, m->size, PROT_NONE, MAP_SHARED | MAP_FIXED, o->fd, (off_t)m->offset);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->taken = 0;
    return sim_map_apply_prot(m);
}

/* Idempotent: a restore that failed half-way can be asked again. */
static CUresult restore_memory(void)
{
    CUresult r = CUDA_SUCCESS;

    for (int i = 0; i < SIM_MAX_OBJS && r == CUDA_SUCCESS; i++)
        r = recreate(&sim.objs[i]);
    for (int i = 0; i < SIM_MAX_MAPS && r == CUDA_SUCCESS; i++)
        if (sim.maps[i].used)
            r = remap(&sim.maps[i]);
    return r;
}

/* The GPUs this process holds state on: a context (primary or not) or
 * memory it owns. The real driver's "checkpointed GPUs", which gpuPairs must
 * all name. */
static unsigned checkpointed_gpus(void)
{
    unsigned mask = 0;

    for (int d = 0; d < sim.ndev; d++)
        if (sim.primary[d].used && sim.primary[d].refs > 0)
            mask |= 1u << d;
    for (int i = 0; i < SIM_MAX_CTXS; i++)
        if (sim.ctxs[i].used && sim.ctxs[i].dev >= 0 && sim.ctxs[i].dev < sim.ndev)
            mask |= 1u << sim.ctxs[i].dev;
    for (int i = 0; i < SIM_MAX_OBJS; i++)
        if (owned(&sim.objs[i]) && sim.objs[i].props.loc_id >= 0 &&
            sim.objs[i].props.loc_id < sim.ndev)
            mask |= 1u << sim.objs[i].props.loc_id;
    return mask;
}

static uint64_t owned_bytes_on(int dev)
{
    uint64_t n = 0;

    for (int i = 0; i < SIM_MAX_OBJS; i++)
        if (owned(&sim.objs[i]) && sim.objs[i].props.loc_id == dev)
            n += sim.objs[i].size;
    return n;
}

static int ordinal_of(uint64_t node, const char uuid[16])
{
    char mine[16];

    for (int d = 0; d < sim.ndev; d++) {
        sim_gpu_uuid(node, sim.gpu[d], mine);
        if (!memcmp(mine, uuid, 16))
            return d;
    }
    return -1;
}

/* The remap as the driver documents it (specs/records/
 * 2026-12-01-gpu-remap.md): every checkpointed GPU named, each once, onto a
 * GPU of the restoring node of the same chip with enough memory. The
 * ordinals stay; the GPU behind each changes (an ordinal no pair names
 * takes a GPU no pair targets, so that the view stays one GPU an ordinal).
 * Decided before anything changes. sim.mu held. */
static CUresult remap_gpus(const struct ck_req *q)
{
    int target[SIM_MAX_DEVICES];
    unsigned named = 0, taken = 0, need = checkpointed_gpus();

    if (q->npairs == 0)
        return q->node == sim.node ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (q->npairs > SIM_MAX_DEVICES || strncmp(q->chip, sim.chip, sizeof sim.chip))
        return CUDA_ERROR_INVALID_VALUE;
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        target[d] = -1;
    for (unsigned i = 0; i < q->npairs; i++) {
        const struct ck_pair *p = &q->pairs[i];
        int d = ordinal_of(sim.node, p->old_uuid);
        int gpu = (unsigned char)p->new_uuid[15];
        char want[16];

        sim_gpu_uuid(q->node, gpu, want);
        if (d < 0 || named >> d & 1u || gpu >= SIM_MAX_DEVICES || taken >> gpu & 1u ||
            memcmp(want, p->new_uuid, 16))
            return CUDA_ERROR_INVALID_VALUE;
        if (owned_bytes_on(d) > q->mem_total)
            return CUDA_ERROR_OUT_OF_MEMORY;
        named |= 1u << d;
        taken |= 1u << gpu;
        target[d] = gpu;
    }
    if ((need & named) != need)
        return CUDA_ERROR_INVALID_VALUE;
    for (int d = 0, gpu = 0; d < sim.ndev; d++) {
        if (target[d] >= 0)
            continue;
        while (gpu < SIM_MAX_DEVICES && taken >> gpu & 1u)
            gpu++;
        if (gpu >= SIM_MAX_DEVICES)
            return CUDA_ERROR_INVALID_VALUE;
        target[d] = gpu;
        taken |= 1u << gpu;
    }
    sim.node = q->node;
    for (int d = 0; d < sim.ndev; d++)
        sim.gpu[d] = (uint8_t)target[d];
    return CUDA_SUCCESS;
}

/* gate_mu held. */
static CUresult do_lock(unsigned timeout_ms)
{
    struct timespec dl;

    if (sim.ck_state != CU_PROCESS_STATE_RUNNING || sim.lock_pending)
        return CUDA_ERROR_ILLEGAL_STATE;
    sim.lock_pending = 1;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    while (sim.in_flight > 0) {
        int e = timeout_ms ? pthread_cond_timedwait(&sim.gate_cv, &sim.gate_mu, &dl)
                           : pthread_cond_wait(&sim.gate_cv, &sim.gate_mu);

        if (e == ETIMEDOUT && sim.in_flight > 0) {
            sim.lock_pending = 0;
            pthread_cond_broadcast(&sim.gate_cv);
            return CUDA_ERROR_NOT_READY;
        }
    }
    sim.lock_pending = 0;
    sim.ck_state = CU_PROCESS_STATE_LOCKED;
    return CUDA_SUCCESS;
}

static CUresult do_op(const struct ck_req *q)
{
    CUresult r = CUDA_SUCCESS;

    switch (q->op) {
    case CK_LOCK:
        return do_lock(q->timeout_ms);
    case CK_CHECKPOINT:
        if (sim.ck_state != CU_PROCESS_STATE_LOCKED)
            return CUDA_ERROR_ILLEGAL_STATE;
        sim_lock();
        r = checkpoint_memory();
        sim_unlock();
        if (r == CUDA_SUCCESS)
            sim.ck_state = CU_PROCESS_STATE_CHECKPOINTED;
        return r;
    case CK_RESTORE:
        if (sim.ck_state != CU_PROCESS_STATE_CHECKPOINTED)
            return CUDA_ERROR_ILLEGAL_STATE;
        sim_lock();
        r = restore_refusal();
        if (r == CUDA_SUCCESS)
            r = remap_gpus(q);
        if (r == CUDA_SUCCESS)
            r = restore_memory();
        sim_unlock();
        if (r == CUDA_SUCCESS)
            sim.ck_state = CU_PROCESS_STATE_LOCKED;
        return r;
    case CK_UNLOCK:
        if (sim.ck_state != CU_PROCESS_STATE_LOCKED)
            return CUDA_ERROR_ILLEGAL_STATE;
        sim.ck_state = CU_PROCESS_STATE_RUNNING;
        pthread_cond_broadcast(&sim.gate_cv);
        return CUDA_SUCCESS;
    case CK_STATE:
    case CK_TID:
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

static int peer_allowed(int fd)
{
    struct ucred cred;
    socklen_t len = sizeof(cred);

    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
        return 0;
    return cred.uid == 0 || cred.uid == getuid();
}

static void serve_one(int fd)
{
    struct ck_req q;
    struct ck_rep p = {0};
    ssize_t n;

    n = recv(fd, &q, sizeof(q), MSG_WAITALL);
    if (n != (ssize_t)sizeof(q) || q.magic != CK_MAGIC || !peer_allowed(fd))
        return;
    pthread_mutex_lock(&sim.gate_mu);
    p.result = (int32_t)do_op(&q);
    p.state = sim.ck_state;
    pthread_mutex_unlock(&sim.gate_mu);
    p.tid = (int32_t)atomic_load(&sim.service_tid);
    /* A controller that hung up must not kill us. */
    (void)!send(fd, &p, sizeof(p), MSG_NOSIGNAL);
}

static void *service_main(void *arg)
{
    sigset_t all;

    (void)arg;
    /* Signals belong to the application's threads. */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    atomic_store(&sim.service_tid, (int)syscall(SYS_gettid));
    for (;;) {
        int c = accept4(sim.service_fd, NULL, NULL, SOCK_CLOEXEC);

        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE)
                continue;
            return NULL;
        }
        serve_one(c);
        close(c);
    }
}

/* A forked child has no service thread and a different pid: like the real
 * driver, it cannot use the parent's CUDA state. */
static void atfork_child(void)
{
    sim.initialized = 0;
}

int sim_service_start(void)
{
    struct sockaddr_un a;
    socklen_t len = ck_addr(&a, ns_inode("self", "pid"), (int)getpid());
    pthread_attr_t attr;
    pthread_t t;
    int fd;

    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (bind(fd, (struct sockaddr *)&a, len) != 0 || listen(fd, 16) != 0)
        goto fail;
    sim.service_fd = fd;
    if (pthread_attr_init(&attr) != 0)
        goto fail;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, service_main, NULL) != 0) {
        pthread_attr_destroy(&attr);
        goto fail;
    }
    pthread_attr_destroy(&attr);
    /* cuInit returns with the service answering: a controller may ask for
     * the restore thread's id right away. */
    while (atomic_load(&sim.service_tid) == 0)
        sched_yield();
    pthread_atfork(NULL, NULL, atfork_child);
    return 0;
fail:
    sim.service_fd = -1;
    close(fd);
    return -1;
}

/* ---- the controller's side -------------------------------------------- */

static CUresult call_req(int pid, struct ck_req *q, struct ck_rep *p)
{
    struct sockaddr_un a;
    socklen_t len;
    char who[16];
    int fd, nspid;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    if (pid <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    /* No service: a live process without CUDA is NOT_INITIALIZED, a pid
     * that does not exist OPERATING_SYSTEM (specs/records). */
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return CUDA_ERROR_OPERATING_SYSTEM;
    snprintf(who, sizeof who, "%d", pid);
    nspid = innermost_pid(pid);
    if (nspid <= 0) /* gone since, or its /proc entry unreadable */
        return CUDA_ERROR_NOT_INITIALIZED;
    len = ck_addr(&a, ns_inode(who, "pid"), nspid);
    fd = socket_in_net_of(pid);
    if (fd < 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    if (connect(fd, (struct sockaddr *)&a, len) != 0) {
        r = (kill(pid, 0) != 0 && errno == ESRCH) ? CUDA_ERROR_OPERATING_SYSTEM
                                                    : CUDA_ERROR_NOT_INITIALIZED;
        goto out;
    }
    if (send(fd, q, sizeof(*q), MSG_NOSIGNAL) != (ssize_t)sizeof(*q))
        goto out;
    if (recv(fd, p, sizeof(*p), MSG_WAITALL) != (ssize_t)sizeof(*p))
        goto out;
    r = (CUresult)p->result;
out:
    close(fd);
    return r;
}

static CUresult call(int pid, uint32_t op, uint32_t timeout_ms, struct ck_rep *p)
{
    struct ck_req q;

    memset(&q, 0, sizeof q);
    q.magic = CK_MAGIC;
    q.op = op;
    q.timeout_ms = timeout_ms;
    return call_req(pid, &q, p);
}

static int zero(const void *p, size_t n)
{
    const unsigned char *b = p;

    for (size_t i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

CUresult CUDAAPI cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)
{
    struct ck_rep p;

    if (args && (args->reserved0 || !zero(args->reserved1, sizeof(args->reserved1))))
        return CUDA_ERROR_INVALID_VALUE;
    return call(pid, CK_LOCK, args ? args->timeoutMs : 0, &p);
}

CUresult CUDAAPI cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)
{
    struct ck_rep p;

    if (args && !zero(args->reserved, sizeof(args->reserved)))
        return CUDA_ERROR_INVALID_VALUE;
#if CUDA_VERSION >= 13040 /* custom storage came with cuCheckpointOperationComplete */
    if (args && args->customStorageInfo_out)
        return CUDA_ERROR_NOT_SUPPORTED;
#endif
    return call(pid, CK_CHECKPOINT, 0, &p);
}

CUresult CUDAAPI cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)
{
    struct ck_rep p;
    struct ck_req q;

    if (args && !zero(args->reserved, sizeof(args->reserved)))
        return CUDA_ERROR_INVALID_VALUE;
#if CUDA_VERSION >= 13040 /* custom storage came with cuCheckpointOperationComplete */
    if (args && args->customStorageInfo_out)
        return CUDA_ERROR_NOT_SUPPORTED;
#endif
    memset(&q, 0, sizeof q);
    q.magic = CK_MAGIC;
    q.op = CK_RESTORE;
    /* The restoring node: this (the controller's) process's. */
    q.node = sim_env_node();
    q.mem_total = (uint64_t)sim_env_long("CUINTERPOSE_SIM_MEM_MIB", (long)SIM_DEFAULT_MEM_MIB, 64,
                                         1L << 30) << 20;
    sim_env_chip(q.chip, sizeof q.chip);
    if (args && args->gpuPairsCount) {
        if (!args->gpuPairs || args->gpuPairsCount > SIM_MAX_DEVICES)
            return CUDA_ERROR_INVALID_VALUE;
        q.npairs = args->gpuPairsCount;
        for (unsigned i = 0; i < args->gpuPairsCount; i++) {
            memcpy(q.pairs[i].old_uuid, args->gpuPairs[i].oldUuid.bytes, 16);
            memcpy(q.pairs[i].new_uuid, args->gpuPairs[i].newUuid.bytes, 16);
        }
    }
    return call_req(pid, &q, &p);
}

CUresult CUDAAPI cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)
{
    struct ck_rep p;

    if (args && !zero(args->reserved, sizeof(args->reserved)))
        return CUDA_ERROR_INVALID_VALUE;
    return call(pid, CK_UNLOCK, 0, &p);
}

CUresult CUDAAPI cuCheckpointProcessGetState(int pid, CUprocessState *state)
{
    struct ck_rep p;
    CUresult r;

    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    r = call(pid, CK_STATE, 0, &p);
    if (r == CUDA_SUCCESS)
        *state = (CUprocessState)p.state;
    return r;
}

CUresult CUDAAPI cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
    struct ck_rep p;
    CUresult r;
    int here;

    if (!tid)
        return CUDA_ERROR_INVALID_VALUE;
    r = call(pid, CK_TID, 0, &p);
    if (r != CUDA_SUCCESS)
        return r;
    here = tid_seen_here(pid, p.tid);
    if (here < 0)
        return CUDA_ERROR_OPERATING_SYSTEM; /* the thread is gone: as for an exited pid */
    *tid = here;
    return CUDA_SUCCESS;
}
