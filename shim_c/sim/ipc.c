/* Legacy CUDA IPC: cuMemAlloc memory and interprocess events shared
 * through 64-byte handles.
 *
 * A memory handle names the whole allocation holding the pointer, as the
 * creating process holds it: its pid, the memfd's number there and its
 * inode (checked on open, so that a freed allocation whose number was
 * reused opens nothing), and the size asked for. cuIpcOpenMemHandle opens
 * that memfd through /proc (same user, as the real driver's IPC needs the
 * same machine) and maps the whole allocation at a new VA: both processes
 * share the bytes for real. Opening a handle in the process that made it
 * fails; a second open in one process counts a reference and returns the
 * same pointer (cuda.h), cuIpcCloseMemHandle unmaps at the last close.
 * Only cuMemAlloc memory has a handle: VMM and pool memory are shared by
 * their own means.
 *
 * An interprocess event's state is a memfd page (device.c); its handle
 * names that memfd the same way, and an opened event maps the page: the
 * records of every process holding the event, and their stream-ordered
 * completion, are the same for all. */
#include "sim.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define IPC_MEM_MAGIC 0x4d435049u   /* "IPCM" */
#define IPC_EVENT_MAGIC 0x45435049u /* "IPCE" */
#define ALLOC_MEMFD "/memfd:cuinterpose-sim-alloc" /* what /proc says an allocation is */

/* The layout of a CUipcMemHandle's or CUipcEventHandle's 64 bytes. */
struct ipc_handle {
    uint32_t magic;
    int32_t pid;
    int32_t fd;
    uint32_t pad;
    uint64_t ino, dev;
    uint64_t bytes; /* memory: the allocation's size as asked for */
    uint64_t id;    /* memory: the creator's allocation id */
    uint64_t off;   /* memory: where it lies in its memfd (a packed request's chunk) */
    uint64_t block; /* memory: the memfd's allocation id (sim_meta.alloc_id) */
};
_Static_assert(sizeof(struct ipc_handle) <= CU_IPC_HANDLE_SIZE, "a handle is 64 bytes");

static CUresult handle_fill(void *out, uint32_t magic, int fd, uint64_t bytes, uint64_t id,
                            uint64_t off, uint64_t block)
{
    struct ipc_handle h = {.magic = magic,
                           .pid = (int32_t)getpid(),
                           .fd = fd,
                           .bytes = bytes,
                           .id = id,
                           .off = off,
                           .block = block};
    struct stat st;

    if (fstat(fd, &st) != 0)
        return CUDA_ERROR_OPERATING_SYSTEM;
    h.ino = (uint64_t)st.st_ino;
    h.dev = (uint64_t)st.st_dev;
    memset(out, 0, CU_IPC_HANDLE_SIZE);
    memcpy(out, &h, sizeof h);
    return CUDA_SUCCESS;
}

/* ---- memory ----------------------------------------------------------- */

static CUresult get_mem_handle(CUipcMemHandle *out, CUdeviceptr dptr)
{
    struct sim_span sp;
    struct sim_map *m;
    struct sim_obj *o;
    CUresult r = CUDA_ERROR_INVALID_VALUE;

    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_lock();
    m = sim_map_find((uintptr_t)dptr);
    o = m ? &sim.objs[m->obj] : NULL;
    /* A packed request's handle names its part of the chunk only: what the
     * importer may reach (the H200 refuses its neighbours there). */
    if (o && !m->taken && o->origin == SIM_FROM_ALLOC && sim_legacy_span(m, (uintptr_t)dptr, &sp))
        r = handle_fill(out->reserved, IPC_MEM_MAGIC, o->fd, sp.bytes, sp.id,
                        sp.base - (m->va - m->offset), o->id);
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    SIM_API(get_mem_handle(pHandle, dptr));
}

/* sim.mu held: this process's open of the allocation `h` names. */
static struct sim_obj *opened(const struct ipc_handle *h)
{
    for (int i = 0; i < SIM_MAX_OBJS; i++) {
        struct sim_obj *o = &sim.objs[i];

        if (o->used && o->origin == SIM_FROM_IPC && o->ipc_refs > 0 && o->peer_pid == h->pid &&
            o->peer_ino == h->ino && o->peer_dev == h->dev && o->id == h->id)
            return o;
    }
    return NULL;
}

/* sim.mu held: the VA of the allocation `o` opened (in its one mapping). */
static uintptr_t base_of(const struct sim_obj *o)
{
    for (int i = 0; i < SIM_MAX_MAPS; i++)
        if (sim.maps[i].used && &sim.objs[sim.maps[i].obj] == o)
            return sim.maps[i].va - sim.maps[i].offset + o->sub_off;
    return 0;
}

/* Why a handle no longer opens: the allocation is gone (freed, or its
 * creator exited) or, still allocated, has had new memory since the handle
 * was made (its creator was checkpointed and restored: the H200 then says
 * CUDA_ERROR_INVALID_HANDLE). The creator's memfds say which: one still
 * carries the allocation's id. */
static int restored_since(const struct ipc_handle *h)
{
    char dir[40];
    struct dirent *d;
    DIR *dp;
    int found = 0;

    snprintf(dir, sizeof dir, "/proc/%d/fd", (int)h->pid);
    dp = opendir(dir);
    if (!dp)
        return 0;
    while (!found && (d = readdir(dp)) != NULL) {
        struct sim_meta meta;
        struct stat st;
        int fd;

        char link[64];
        ssize_t n;

        if (d->d_name[0] == '.')
            continue;
        /* Only the simulator's allocations: opening anything else could have
         * effects (a terminal, a device). */
        n = readlinkat(dirfd(dp), d->d_name, link, sizeof link - 1);
        if (n <= 0)
            continue;
        link[n] = '\0';
        if (strncmp(link, ALLOC_MEMFD, sizeof ALLOC_MEMFD - 1) != 0)
            continue;
        fd = openat(dirfd(dp), d->d_name, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
        if (fd < 0)
            continue;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size > SIM_META_SIZE &&
            pread(fd, &meta, sizeof meta, st.st_size - (off_t)SIM_META_SIZE) ==
                (ssize_t)sizeof meta)
            found = meta.magic == SIM_META_MAGIC && meta.kind == SIM_KIND_ALLOC &&
                    meta.creator_pid == h->pid && meta.alloc_id == h->block;
        close(fd);
    }
    closedir(dp);
    return found;
}

/* The allocation's device may access it, and the opening context's device
 * when it is the same one or peer access is asked for lazily. */
static CUresult open_map(struct sim_obj *o, unsigned flags, int dev, uintptr_t *va)
{
    struct sim_map *m;
    CUresult r = sim_map_fresh(o, va);

    if (r != CUDA_SUCCESS)
        return r;
    sim_lock();
    m = sim_map_find(*va);
    m->access[o->props.loc_id] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (dev == o->props.loc_id || (flags & CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        m->access[dev] = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = sim_map_apply_prot(m);
    sim_unlock();
    if (r != CUDA_SUCCESS)
        sim_unmap_fresh(*va);
    return r;
}

static CUresult open_mem_handle(CUdeviceptr *out, CUipcMemHandle handle, unsigned flags)
{
    struct ipc_handle h;
    struct sim_obj *o;
    uintptr_t va = 0;
    int dev, fd;
    CUresult r;

    if (!out || (flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_current_dev(&dev);
    if (r != CUDA_SUCCESS)
        return r;
    memcpy(&h, handle.reserved, sizeof h);
    if (h.magic != IPC_MEM_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    /* The real driver refuses its own handles (no peer context to open). */
    if (h.pid == (int32_t)getpid())
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_lock();
    o = opened(&h);
    if (o) {
        o->ipc_refs++;
        va = base_of(o);
    }
    sim_unlock();
    if (o) {
        *out = (CUdeviceptr)va;
        return CUDA_SUCCESS;
    }
    fd = sim_peer_fd_open(h.pid, h.fd, h.ino, h.dev);
    if (fd < 0)
        return restored_since(&h) ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_VALUE;
    r = sim_obj_import_fd(fd, &o);
    if (r != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    o->legacy = 1;
    o->origin = SIM_FROM_IPC;
    o->bytes = h.bytes;
    o->ctx = sim_current_ctx();
    o->ipc_refs = 1;
    o->id = h.id; /* BUFFER_ID and MEMORY_BLOCK_ID are the creator's (H200) */
    o->peer_pid = h.pid;
    o->peer_ino = h.ino;
    o->peer_dev = h.dev;
    o->sub_off = h.off;
    if (h.bytes == 0 || h.off > o->size || h.bytes > o->size - h.off)
        r = CUDA_ERROR_INVALID_VALUE;
    sim_unlock();
    if (r == CUDA_SUCCESS)
        r = open_map(o, flags, dev, &va);
    va += o->sub_off;
    if (r != CUDA_SUCCESS) {
        sim_lock();
        o->handle_refs = 0;
        sim_obj_unref(o);
        sim_unlock();
        return r;
    }
    *out = (CUdeviceptr)va;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                       unsigned int Flags)
{
    SIM_API(open_mem_handle(pdptr, handle, Flags));
}

/* The 4.1 ABI under its own name: the same call. */
CUresult CUDAAPI sim_ipc_open_mem_v1(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    SIM_API(open_mem_handle(pdptr, handle, Flags));
}

static CUresult close_mem_handle(CUdeviceptr dptr)
{
    uintptr_t va;
    struct sim_map *m;
    struct sim_obj *o;
    int last;

    if (!sim_current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    sim_lock();
    m = sim_map_find((uintptr_t)dptr);
    o = m ? &sim.objs[m->obj] : NULL;
    if (!o || o->origin != SIM_FROM_IPC || m->va + o->sub_off != (uintptr_t)dptr ||
        o->ipc_refs <= 0) {
        sim_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    last = --o->ipc_refs == 0;
    va = m->va;
    sim_unlock();
    return last ? sim_unmap_fresh(va) : CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    SIM_API(close_mem_handle(dptr));
}

/* ---- events ----------------------------------------------------------- */

static CUresult get_event_handle(CUipcEventHandle *out, CUevent event)
{
    struct sim_event *e;
    CUresult r;

    if (!out || !event)
        return CUDA_ERROR_INVALID_VALUE; /* a NULL event: seen on the H200 */
    sim_lock();
    e = sim_event_check(event);
    if (!e)
        r = CUDA_ERROR_INVALID_HANDLE;
    else if (!(e->flags & CU_EVENT_INTERPROCESS) || !e->shared)
        r = CUDA_ERROR_INVALID_VALUE;
    else
        r = handle_fill(out->reserved, IPC_EVENT_MAGIC, e->fd, 0, 0, 0, 0);
    sim_unlock();
    return r;
}

CUresult CUDAAPI cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event)
{
    SIM_API(get_event_handle(pHandle, event));
}

/* An opened event behaves like one created with CU_EVENT_DISABLE_TIMING
 * (cuda.h), sharing the creator's state page. */
static CUresult open_event_handle(CUevent *out, CUipcEventHandle handle)
{
    struct sim_event_shared *sh;
    struct sim_event *e;
    struct ipc_handle h;
    CUresult r;
    int fd;

    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    if (!sim_current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    memcpy(&h, handle.reserved, sizeof h);
    if (h.magic != IPC_EVENT_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    if (h.pid == (int32_t)getpid())
        return CUDA_ERROR_INVALID_CONTEXT;
    fd = sim_peer_fd_open(h.pid, h.fd, h.ino, h.dev);
    if (fd < 0)
        return CUDA_ERROR_INVALID_VALUE; /* destroyed by its creator */
    sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (sh == MAP_FAILED || sh->magic != SIM_EVENT_MAGIC) {
        if (sh != MAP_FAILED)
            munmap(sh, sizeof(*sh));
        close(fd);
        return CUDA_ERROR_INVALID_VALUE;
    }
    sim_lock();
    r = sim_event_new(CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS, &e);
    if (r == CUDA_SUCCESS) {
        e->opened = 1;
        e->fd = fd;
        e->shared = sh;
    }
    sim_unlock();
    if (r != CUDA_SUCCESS) {
        munmap(sh, sizeof(*sh));
        close(fd);
        return r;
    }
    *out = (CUevent)e;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle)
{
    SIM_API(open_event_handle(phEvent, handle));
}
