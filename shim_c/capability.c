/*
 * Capabilities: what the application holds instead of a raw CUDA FD.
 *
 * Export hands out a sealed memfd (write, shrink, grow and seal sealed)
 * holding one struct cuip_capability: creator participant, resource id,
 * 16 random bytes of authorization (one per allocation, so a capability
 * exported before a checkpoint stays valid after the restore), the
 * creator's socket name, size and handle types. Import of a capability
 * connects to the creator's endpoint, sends EXPORT (id + authorization),
 * receives a fresh raw FD over SCM_RIGHTS, imports it and closes it at once.
 * The EXPORT request carries the importer's participant id; the creator
 * keeps who fetched each allocation (FETCH records), so that the coordinator
 * can refuse a team that leaves a live importer out. The importer trusts the
 * answering socket only when its owner (SO_PEERCRED) is root or our uid and
 * the reply names the creator the capability names.
 *
 * Known limits (documented): an FD alias the shim cannot see (dup, foreign
 * SCM_RIGHTS) is fine, but a capability keeps nothing alive by itself: once
 * the creator released every handle and mapping, import fails, where a raw
 * exported FD would have kept the memory
 * (specs/records/2026-11-29-h200-driver-rules.jsonl).
 */
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define CAP_SEALS (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* ------------------------------------------------------------ format */
int cap_create(const struct obj *o)
{
    struct cuip_capability c;
    const char *endpoint = o->is_creator ? g.sock_name : o->endpoint;
    int fd;

    memset(&c, 0, sizeof c);
    c.magic = CUIP_CAP_MAGIC;
    c.version = CUIP_CAP_VERSION;
    c.resource_kind = o->kind == OBJ_MC ? CUIP_RESOURCE_MULTICAST : CUIP_RESOURCE_UNICAST;
    memcpy(c.creator, o->creator, CUIP_PARTICIPANT_LEN);
    memcpy(c.resource_id, o->id, CUIP_ID_LEN);
    memcpy(c.authorization, o->auth, CUIP_AUTH_LEN);
    strncpy(c.endpoint, endpoint, CUIP_CAP_ENDPOINT_LEN);
    c.size = o->size;
    c.handle_types = (uint32_t)o->handle_types;
    if (o->kind == OBJ_MC) {
        c.num_devices = (uint16_t)o->mcprop.numDevices;
        c.flags = (uint16_t)o->mcprop.flags;
    }

    fd = memfd_create("cuinterpose-capability", MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (write(fd, &c, sizeof c) != (ssize_t)sizeof c)
        goto fail;
    if (fcntl(fd, F_ADD_SEALS, CAP_SEALS) != 0)
        goto fail;
    return fd;
fail:
    close(fd);
    return -1;
}

static bool endpoint_ok(const char *e)
{
    size_t n = strnlen(e, CUIP_CAP_ENDPOINT_LEN), pl = strlen(CUIP_SOCKET_PREFIX),
           sl = strlen(CUIP_SOCKET_SUFFIX);
    if (n == CUIP_CAP_ENDPOINT_LEN || n <= pl + sl)
        return false;
    if (strncmp(e, CUIP_SOCKET_PREFIX, pl) || strcmp(e + n - sl, CUIP_SOCKET_SUFFIX))
        return false;
    for (size_t i = pl; i < n - sl; i++)
        if (e[i] < '0' || e[i] > '9')
            return false;
    /* Zero padding after the name. */
    return shim_is_zero(e + n, CUIP_CAP_ENDPOINT_LEN - n);
}

enum cap_kind cap_parse(int fd, struct cuip_capability *c)
{
    struct stat st;
    int seals;

    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != (off_t)sizeof *c)
        return CAP_NONE;
    seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & CAP_SEALS) != CAP_SEALS)
        return CAP_NONE;
    if (pread(fd, c, sizeof *c, 0) != (ssize_t)sizeof *c || c->magic != CUIP_CAP_MAGIC)
        return CAP_NONE;
    /* From here on it claims to be one of ours: anything odd is malformed. */
    if (c->version != CUIP_CAP_VERSION ||
        (c->resource_kind != CUIP_RESOURCE_UNICAST &&
         (c->resource_kind != CUIP_RESOURCE_MULTICAST || c->num_devices == 0)) ||
        !shim_is_participant(c->creator) || shim_is_zero(c->resource_id, CUIP_ID_LEN) ||
        !endpoint_ok(c->endpoint) || c->size == 0)
        return CAP_MALFORMED;
    return CAP_VALID;
}

/* The object kind a capability's resource kind names. */
static enum obj_kind kind_of(uint32_t resource_kind)
{
    return resource_kind == CUIP_RESOURCE_MULTICAST ? OBJ_MC : OBJ_ALLOC;
}

/* ------------------------------------------------------------ peer client */
/* The server's owner must be one we trust: a socket planted under the
 * creator's name by another user would otherwise hand us its memory. */
static bool server_trusted(int fd, const char *path, char *msg, size_t n)
{
    struct ucred cr;
    socklen_t cl = sizeof cr;

    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0) {
        snprintf(msg, n, "SO_PEERCRED on %s: %s", path, strerror(errno));
        return false;
    }
    if (!shim_trusted_uid(cr.uid)) {
        snprintf(msg, n, "%s is served by pid %d of uid %d, not root nor uid %d: not trusted",
                 path, (int)cr.pid, (int)cr.uid, (int)getuid());
        return false;
    }
    return true;
}

/* Ten heal periods of the creator's listener (control.c's CONTROL_HEAL_MS). */
#define HEAL_WAIT_NS ms_to_ns(1000)

/* Whether the process whose endpoint name this is ("cuinterpose-<pid>.sock")
 * lives, as far as this pid namespace shows (a name we cannot read: alive). */
static bool endpoint_pid_alive(const char *endpoint)
{
    char name[CUIP_CAP_ENDPOINT_LEN + 1];
    int pid;

    memcpy(name, endpoint, CUIP_CAP_ENDPOINT_LEN);
    name[CUIP_CAP_ENDPOINT_LEN] = 0;
    if (sscanf(name, CUIP_SOCKET_PREFIX "%d", &pid) != 1 || pid <= 0)
        return true;
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

static int connect_endpoint(const char *endpoint, char *msg, size_t n)
{
    struct sockaddr_un a;
    int fd, len;

    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    len = snprintf(a.sun_path, sizeof a.sun_path, "%s/%.*s", g.control_dir,
                   CUIP_CAP_ENDPOINT_LEN, endpoint);
    if (len < 0 || (size_t)len >= sizeof a.sun_path) {
        snprintf(msg, n, "endpoint path too long");
        return -1;
    }
    for (uint64_t since = shim_now_ns();;) {
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            snprintf(msg, n, "socket: %s", strerror(errno));
            return -1;
        }
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0)
            break;
        int err = errno;
        bool gone = err == ECONNREFUSED || err == ENOENT;
        snprintf(msg, n, "connect %s: %s", a.sun_path, strerror(err));
        close(fd);
        if (!gone)
            return -1;
        /* A live creator re-creates its endpoint within CONTROL_HEAL_MS: it is
         * gone only when its process is, or the endpoint stays away. */
        if (!endpoint_pid_alive(endpoint) || shim_now_ns() - since > HEAL_WAIT_NS)
            return CAP_CREATOR_GONE;
        usleep(10000);
    }
    if (!server_trusted(fd, a.sun_path, msg, n)) {
        close(fd);
        return -1;
    }
    return fd;
}

void cap_ref_of(const struct obj *o, struct cap_ref *ref)
{
    memset(ref, 0, sizeof *ref);
    ref->kind = o->kind == OBJ_MC ? CUIP_RESOURCE_MULTICAST : CUIP_RESOURCE_UNICAST;
    memcpy(ref->creator, o->creator, CUIP_PARTICIPANT_LEN);
    memcpy(ref->id, o->id, CUIP_ID_LEN);
    memcpy(ref->auth, o->auth, CUIP_AUTH_LEN);
    memcpy(ref->endpoint, o->endpoint, CUIP_CAP_ENDPOINT_LEN);
    /* A legacy IPC import was handed its range, a capability its size. */
    ref->size = o->own && o->own->nranges ? o->own->ranges[0].size : o->size;
}

/* One EXPORT exchange: a fetch (the FD, or -1/CAP_CREATOR_GONE and msg) or,
 * with `withdraw`, the creator told to forget this process's fetch (0). */
static int export_call(const struct cap_ref *ref, uint64_t withdraw, char *msg, size_t n)
{
    struct {
        struct cuip_header h;
        char fetcher[CUIP_PARTICIPANT_LEN];
    } req;
    struct cuip_header rep;
    uint64_t deadline = shim_now_ns() + ms_to_ns((uint64_t)shim_settings()->peer_timeout_ms);
    int s, got = -1, extra = -1, failed = -1;
    char text[CUIP_MESSAGE_MAX + 1];

    if (!g.control_dir[0]) {
        snprintf(msg, n, "no control directory: cannot reach the creator");
        return -1;
    }
    s = connect_endpoint(ref->endpoint, msg, n);
    if (s < 0)
        return s;
    memset(&req, 0, sizeof req);
    req.h.magic = CUIP_MAGIC;
    req.h.version = CUIP_VERSION;
    req.h.op = CUIP_OP_EXPORT;
    memcpy(req.h.participant, ref->creator, CUIP_PARTICIPANT_LEN);
    memcpy(req.h.resource_id, ref->id, CUIP_ID_LEN);
    memcpy(req.h.authorization, ref->auth, CUIP_AUTH_LEN);
    req.h.resource_kind = ref->kind;
    req.h.message_length = CUIP_PARTICIPANT_LEN;
    cuip_set_export_size(&req.h, ref->size);
    cuip_set_export_withdraw(&req.h, withdraw);
    pthread_mutex_lock(&g.lock);
    memcpy(req.fetcher, g.participant, CUIP_PARTICIPANT_LEN);
    pthread_mutex_unlock(&g.lock);
    if (io_write_all(s, &req, sizeof req, deadline) != 0) {
        snprintf(msg, n, "EXPORT request to %.*s: %s", CUIP_CAP_ENDPOINT_LEN, ref->endpoint,
                 strerror(errno));
        goto fail;
    }
    failed = CAP_FETCH_LOST; /* from here on the creator may have recorded the fetch */
    if (io_read_all(s, &rep, sizeof rep, deadline, &got) != 0) {
        snprintf(msg, n, "EXPORT reply from %.*s: %s", CUIP_CAP_ENDPOINT_LEN, ref->endpoint,
                 errno ? strerror(errno) : "connection closed");
        goto fail;
    }
    if (rep.magic != CUIP_MAGIC || rep.version != CUIP_VERSION || rep.op != CUIP_OP_EXPORT ||
        memcmp(rep.participant, ref->creator, CUIP_PARTICIPANT_LEN) ||
        rep.message_length > CUIP_MESSAGE_MAX || rep.count != 0) {
        snprintf(msg, n, "malformed EXPORT reply from %.*s", CUIP_CAP_ENDPOINT_LEN,
                 ref->endpoint);
        goto fail;
    }
    memset(text, 0, sizeof text);
    if (rep.message_length &&
        io_read_all(s, text, rep.message_length, deadline, got < 0 ? &got : &extra) != 0) {
        snprintf(msg, n, "truncated EXPORT reply from %.*s", CUIP_CAP_ENDPOINT_LEN,
                 ref->endpoint);
        goto fail;
    }
    if (rep.status != CUIP_STATUS_OK) {
        snprintf(msg, n, "creator %.*s refused EXPORT (status %d): %s", CUIP_PARTICIPANT_LEN,
                 ref->creator, rep.status, text);
        failed = -1; /* refused: nothing recorded */
        goto fail;
    }
    if (withdraw ? got >= 0 : got < 0) {
        snprintf(msg, n, "EXPORT reply from %.*s %s a file descriptor", CUIP_CAP_ENDPOINT_LEN,
                 ref->endpoint, withdraw ? "carried" : "carried no");
        goto fail;
    }
    if (extra >= 0)
        close(extra);
    close(s);
    return withdraw ? 0 : got;
fail:
    if (got >= 0)
        close(got);
    if (extra >= 0)
        close(extra);
    close(s);
    return failed;
}

int cap_fetch(const struct cap_ref *ref, char *msg, size_t n)
{
    return export_call(ref, 0, msg, n);
}

void cap_withdraw(const struct cap_ref *ref)
{
    char msg[512];

    if (export_call(ref, CUIP_EXPORT_WITHDRAW, msg, sizeof msg) != 0)
        shim_log(LOG_WARN, "telling creator %.*s that the import failed here: %s "
                 "(its FETCH record of this process stays until this process exits)",
                 CUIP_PARTICIPANT_LEN, ref->creator, msg);
}

int cap_import(const struct cap_ref *ref, CUmemGenericAllocationHandle *out, CUresult *cr,
               char *msg, size_t n)
{
    CUmemGenericAllocationHandle h;
    int fd = cap_fetch(ref, msg, n);

    if (fd < 0)
        return fd;
    *cr = real.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (*cr != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuMemImportFromShareableHandle", *cr);
        return CAP_IMPORT_FAILED;
    }
    if (SHIM_IS_TAGGED(h)) {
        real.cuMemRelease(h);
        *cr = CUDA_ERROR_NOT_SUPPORTED;
        snprintf(msg, n, "driver handle collides with the shim's tag range");
        return CAP_IMPORT_FAILED;
    }
    *out = h;
    return 0;
}

int cap_import_again(const struct obj *o, CUmemGenericAllocationHandle *out, char *msg,
                     size_t n)
{
    struct cap_ref ref;
    bool pushed;
    CUresult cr = shim_ctx_enter(o->ctx, &pushed);
    int got;

    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, n, "cuCtxPushCurrent", cr);
        return -1;
    }
    cap_ref_of(o, &ref);
    got = cap_import(&ref, out, &cr, msg, n);
    shim_ctx_leave(pushed);
    return got;
}

struct obj *cap_adopt_import(CUmemGenericAllocationHandle h, const struct cap_ref *ref,
                             uint64_t handle_types)
{
    struct obj *o = obj_adopt(kind_of(ref->kind), h); /* releases h on failure */

    if (!o)
        return NULL;
    memcpy(o->id, ref->id, CUIP_ID_LEN);
    memcpy(o->creator, ref->creator, CUIP_PARTICIPANT_LEN);
    memcpy(o->auth, ref->auth, CUIP_AUTH_LEN);
    memcpy(o->endpoint, ref->endpoint, CUIP_CAP_ENDPOINT_LEN);
    o->has_auth = true;
    o->imported = true;
    o->size = ref->size;
    o->handle_types = handle_types;
    if (o->kind == OBJ_ALLOC) {
        if (real.cuMemGetAllocationPropertiesFromHandle(&o->prop, h) != CUDA_SUCCESS)
            memset(&o->prop, 0, sizeof o->prop);
        o->prop.win32HandleMetaData = NULL;
    }
    return o;
}

/* ------------------------------------------------------------ EXPORT server */
/* Where a creator's allocations are live for its importers: the phases
 * CUIP_OPS serves EXPORT in. */
static bool export_phase_ok(uint16_t p)
{
    return cuip_op_served_in(CUIP_OP_EXPORT, p);
}

/* A fetcher whose process is known to be gone no longer holds anything it
 * could keep from the team; pid 0 (not visible here) is kept. */
static bool fetch_live(const struct fetch *f)
{
    return f->pid <= 0 || kill(f->pid, 0) == 0 || errno != ESRCH;
}

/* Under g.lock: forget the fetchers known to be gone, so that a creator that
 * served many short-lived importers keeps only the living. */
static void prune_fetches(struct obj *o)
{
    for (uint32_t k = 0; k < o->nfetches;)
        if (fetch_live(&o->fetches[k]))
            k++;
        else
            o->fetches[k] = o->fetches[--o->nfetches];
}

/* Under g.lock: a withdrawn fetch (the importer's open failed there). */
static void forget_fetch(struct obj *o, const char fetcher[CUIP_PARTICIPANT_LEN], pid_t pid)
{
    for (uint32_t k = 0; k < o->nfetches; k++)
        if (!memcmp(o->fetches[k].participant, fetcher, CUIP_PARTICIPANT_LEN) &&
            o->fetches[k].pid == pid) {
            o->fetches[k] = o->fetches[--o->nfetches];
            return;
        }
}

/* What a creator handed out of `o`: the range cuMemAlloc returned (owned
 * memory), else the allocation's or multicast object's size. */
static uint64_t served_size(const struct obj *o)
{
    if (o->own)
        return o->own->nranges && o->own->ranges[0].live ? o->own->ranges[0].size : 0;
    return o->size;
}

void cap_serve_export(const struct cuip_header *req, const char fetcher[CUIP_PARTICIPANT_LEN],
                      pid_t pid, struct reply *r)
{
    struct obj *o;
    bool pushed;
    int fd = -1;
    CUresult cr;
    char msg[256];

    pthread_mutex_lock(&g.lock);
    if (!export_phase_ok(g.phase)) {
        reply_msg(r, CUIP_STATUS_WRONG_PHASE, "EXPORT is not served in phase %u", g.phase);
        goto out;
    }
    o = obj_by_id(req->resource_id);
    if (!o || o->kind != kind_of(req->resource_kind) || !o->is_creator || !o->has_auth ||
        obj_unused(o)) {
        reply_msg(r, CUIP_STATUS_NOT_FOUND, "no exported %s with that id",
                  req->resource_kind == CUIP_RESOURCE_MULTICAST ? "multicast object"
                                                                : "allocation");
        goto out;
    }
    if (!shim_ct_equal(o->auth, req->authorization, CUIP_AUTH_LEN)) {
        reply_msg(r, CUIP_STATUS_UNAUTHORIZED, "bad authorization");
        goto out;
    }
    if (cuip_export_withdraw(req)) {
        forget_fetch(o, fetcher, pid);
        r->h.status = CUIP_STATUS_OK;
        goto out;
    }
    if (!cuip_export_size(req) || cuip_export_size(req) != served_size(o)) {
        /* A handle rewritten to another size names nothing handed out. */
        reply_msg(r, CUIP_STATUS_UNAUTHORIZED, "size %llu is not what was handed out",
                  (unsigned long long)cuip_export_size(req));
        goto out;
    }
    if (!o->live) {
        reply_msg(r, CUIP_STATUS_NOT_FOUND, "allocation is not loaded");
        goto out;
    }
    /* Export is a short driver call: held under the lock so the handle
     * cannot be released underneath it. */
    cr = shim_ctx_enter(o->ctx, &pushed);
    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, sizeof msg, "cuCtxPushCurrent", cr);
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "%s", msg);
        goto out;
    }
    cr = real.cuMemExportToShareableHandle(&fd, o->real,
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    shim_ctx_leave(pushed);
    if (cr != CUDA_SUCCESS) {
        shim_fail(msg, sizeof msg, "cuMemExportToShareableHandle", cr);
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "%s", msg);
        goto out;
    }
    if (o->nfetches == o->capfetches)
        prune_fetches(o); /* before the table grows: amortized, one kill() a fetch */
    if (obj_add_fetch(o, fetcher, pid) != 0) {
        /* Unrecorded, the importer could be left out of a capture unseen. */
        close(fd);
        reply_msg(r, CUIP_STATUS_INTERNAL, "out of memory recording the fetch");
        goto out;
    }
    r->fd = fd;
    r->h.status = CUIP_STATUS_OK;
out:
    pthread_mutex_unlock(&g.lock);
}

static bool reported_creation(const struct obj *o)
{
    return o->kind == OBJ_ALLOC && o->is_creator && !obj_unused(o) && obj_shared(o);
}

int cap_inspect_fetches(struct reply *r)
{
    uint32_t n = obj_count(), extra = 0, at = r->h.count;
    struct cuip_record *recs;

    for (uint32_t i = 0; i < n; i++) {
        struct obj *o = obj_at(i);
        if (o && reported_creation(o)) {
            prune_fetches(o); /* the limit counts the living only */
            extra += o->nfetches;
        }
    }
    if (!extra)
        return 0;
    if ((uint64_t)at + extra > CUIP_RECORDS_MAX) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "%u records exceed the limit of %u", at + extra,
                  CUIP_RECORDS_MAX);
        return -1;
    }
    recs = realloc(r->records, (size_t)(at + extra) * sizeof *recs);
    if (!recs) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "out of memory building FETCH records");
        return -1;
    }
    r->records = recs;
    for (uint32_t i = 0; i < n; i++) {
        struct obj *o = obj_at(i);
        if (!o || !reported_creation(o))
            continue;
        for (uint32_t k = 0; k < o->nfetches; k++) {
            const struct fetch *f = &o->fetches[k];
            struct cuip_record *rec = &recs[at];
            uint8_t raw[CUIP_PARTICIPANT_LEN / 2];
            if (!shim_unhex(raw, f->participant, CUIP_PARTICIPANT_LEN))
                continue;
            memset(rec, 0, sizeof *rec);
            rec->kind = CUIP_RECORD_FETCH;
            memcpy(rec->id, o->id, CUIP_ID_LEN);
            memcpy(rec->member_id, raw, sizeof raw);
            memcpy(rec->creator, o->creator, CUIP_PARTICIPANT_LEN);
            rec->pid = (uint32_t)f->pid;
            at++;
        }
    }
    r->h.count = at;
    return 0;
}

/* ------------------------------------------------------------ application calls */
static CUresult export_handle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                              CUmemAllocationHandleType handleType, unsigned long long flags)
{
    struct obj *o;
    int raw = -1, cap;
    CUresult r = shim_enter();

    if (r != CUDA_SUCCESS)
        return r;
    if (!SHIM_IS_TAGGED(handle))
        return real.cuMemExportToShareableHandle(shareableHandle, handle, handleType, flags);
    pthread_mutex_lock(&g.lock);
    if (g.phase != CUIP_PHASE_ACTIVE) {
        r = CUDA_ERROR_NOT_READY;
        goto out;
    }
    o = obj_lookup(handle, true);
    if (!o) {
        r = CUDA_ERROR_INVALID_VALUE;
        goto out;
    }
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || o->kind == OBJ_FREE ||
        o->raw_import || !shareableHandle || !g.sock_name[0]) {
        /* Not something a capability stands for (other handle types, raw
         * imports, or no control server): the driver's own answer; INSPECT
         * reports these so capture refuses. */
        if (handleType == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && o->kind != OBJ_FREE &&
            !o->raw_import && !g.sock_name[0])
            shim_log(LOG_WARN, "no control server: exporting a raw FD (not capturable)");
        r = real.cuMemExportToShareableHandle(shareableHandle, o->real, handleType, flags);
        goto out;
    }
    if (o->is_creator) {
        /* The driver decides whether this export is legal (handle types,
         * flags); its FD itself is not needed. */
        r = real.cuMemExportToShareableHandle(&raw, o->real, handleType, flags);
        if (r != CUDA_SUCCESS)
            goto out;
        close(raw);
        if (!o->has_auth) {
            if (shim_random(o->auth, CUIP_AUTH_LEN) != 0) {
                r = CUDA_ERROR_OPERATING_SYSTEM;
                goto out;
            }
            o->has_auth = true;
        }
    }
    cap = cap_create(o);
    if (cap < 0) {
        shim_log(LOG_ERROR, "cannot create a capability: %s", strerror(errno));
        r = CUDA_ERROR_OPERATING_SYSTEM;
        goto out;
    }
    o->exported = true;
    *(int *)shareableHandle = cap;
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

/* A tracked object for a raw (non-capability) import: reported RAW_IMPORT. */
static CUresult track_raw(CUmemGenericAllocationHandle *handle, CUmemGenericAllocationHandle h,
                          CUmemAllocationHandleType type)
{
    struct obj *o = obj_adopt(OBJ_ALLOC, h);
    if (!o)
        return CUDA_ERROR_OUT_OF_MEMORY;
    o->raw_import = true;
    o->handle_types = (uint64_t)type;
    if (real.cuMemGetAllocationPropertiesFromHandle(&o->prop, h) != CUDA_SUCCESS)
        memset(&o->prop, 0, sizeof o->prop);
    o->prop.win32HandleMetaData = NULL;
    shim_log(LOG_INFO, "import of a raw FD: tracked as RAW_IMPORT (capture will refuse)");
    *handle = obj_handle(o);
    return CUDA_SUCCESS;
}

static CUresult import_raw(CUmemGenericAllocationHandle *handle, void *osHandle,
                           CUmemAllocationHandleType type)
{
    CUmemGenericAllocationHandle h;
    CUresult r;

    pthread_mutex_lock(&g.lock);
    if (g.phase != CUIP_PHASE_ACTIVE) {
        r = CUDA_ERROR_NOT_READY;
        goto out;
    }
    r = real.cuMemImportFromShareableHandle(&h, osHandle, type);
    if (r != CUDA_SUCCESS)
        goto out;
    if (SHIM_IS_TAGGED(h)) {
        real.cuMemRelease(h);
        r = CUDA_ERROR_NOT_SUPPORTED;
        goto out;
    }
    r = track_raw(handle, h, type);
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

/* Under g.lock: one more application handle on a known object, if the
 * capability's authorization matches and it is still alive. */
static bool reuse_known(const struct cuip_capability *c, CUmemGenericAllocationHandle *handle,
                        CUresult *r)
{
    struct obj *o = obj_by_id(c->resource_id);
    if (!o)
        return false;
    if (o->kind != kind_of(c->resource_kind) || !o->has_auth || obj_unused(o) || !o->live ||
        !shim_ct_equal(o->auth, c->authorization, CUIP_AUTH_LEN)) {
        *r = CUDA_ERROR_INVALID_VALUE;
        return true;
    }
    o->refs++;
    *handle = obj_handle(o);
    *r = CUDA_SUCCESS;
    return true;
}

static void cap_ref_from(const struct cuip_capability *c, struct cap_ref *ref)
{
    memset(ref, 0, sizeof *ref);
    ref->kind = c->resource_kind;
    memcpy(ref->creator, c->creator, CUIP_PARTICIPANT_LEN);
    memcpy(ref->id, c->resource_id, CUIP_ID_LEN);
    memcpy(ref->auth, c->authorization, CUIP_AUTH_LEN);
    memcpy(ref->endpoint, c->endpoint, CUIP_CAP_ENDPOINT_LEN);
    ref->size = c->size;
}

/* Under g.lock: the importer's object for capability `c`, imported as `h`. */
static CUresult adopt_cap(CUmemGenericAllocationHandle *handle, CUmemGenericAllocationHandle h,
                          const struct cap_ref *ref, const struct cuip_capability *c)
{
    struct obj *o = cap_adopt_import(h, ref, c->handle_types);

    if (!o)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (o->kind == OBJ_MC) {
        /* What the creator created with; only it creates again. */
        o->mcprop.size = c->size;
        o->mcprop.handleTypes = c->handle_types;
        o->mcprop.numDevices = c->num_devices;
        o->mcprop.flags = c->flags;
        o->unsupported = c->handle_types & ~(uint32_t)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    } else {
        o->prop.requestedHandleTypes = (CUmemAllocationHandleType)c->handle_types;
    }
    *handle = obj_handle(o);
    return CUDA_SUCCESS;
}

static CUresult import_cap(CUmemGenericAllocationHandle *handle, const struct cuip_capability *c)
{
    CUmemGenericAllocationHandle h;
    struct cap_ref ref;
    char msg[512];
    CUresult r = CUDA_SUCCESS;
    bool held = false;
    int got;

    pthread_mutex_lock(&g.lock);
    if (g.phase != CUIP_PHASE_ACTIVE) {
        pthread_mutex_unlock(&g.lock);
        return CUDA_ERROR_NOT_READY;
    }
    if (reuse_known(c, handle, &r)) {
        pthread_mutex_unlock(&g.lock);
        return r;
    }
    if (!memcmp(c->creator, g.participant, CUIP_PARTICIPANT_LEN)) {
        /* Our own capability whose allocation is gone: the driver would
         * have kept it alive through the FD; a capability cannot. */
        pthread_mutex_unlock(&g.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g.lock);

    cap_ref_from(c, &ref);
    got = cap_import(&ref, &h, &r, msg, sizeof msg);
    if (got != 0) {
        shim_log(LOG_WARN, "import of a capability failed: %s", msg);
        if (got == CAP_IMPORT_FAILED || got == CAP_FETCH_LOST)
            cap_withdraw(&ref);
        return got == CAP_IMPORT_FAILED ? r : CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&g.lock);
    if (g.phase != CUIP_PHASE_ACTIVE) {
        real.cuMemRelease(h);
        r = CUDA_ERROR_NOT_READY;
    } else if (reuse_known(c, handle, &r)) {
        real.cuMemRelease(h); /* another thread imported it meanwhile */
        held = r == CUDA_SUCCESS;
    } else {
        r = adopt_cap(handle, h, &ref, c);
        held = r == CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g.lock);
    if (!held)
        cap_withdraw(&ref);
    return r;
}

static CUresult import_handle(CUmemGenericAllocationHandle *handle, void *osHandle,
                              CUmemAllocationHandleType shHandleType)
{
    struct cuip_capability c;
    CUresult r = shim_enter();
    enum cap_kind kind;

    if (r != CUDA_SUCCESS)
        return r;
    if (!handle)
        return real.cuMemImportFromShareableHandle(handle, osHandle, shHandleType);
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return import_raw(handle, osHandle, shHandleType);
    kind = cap_parse((int)(intptr_t)osHandle, &c);
    if (kind == CAP_MALFORMED) {
        shim_log(LOG_WARN, "import of a malformed cuinterpose capability refused");
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (kind == CAP_NONE)
        return import_raw(handle, osHandle, shHandleType);
    return import_cap(handle, &c);
}

/* Export and import pass the gate for their whole length (an import asks
 * the creator between two looks at the tables): QUIESCE waits for them. */
CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle,
                                              CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType handleType,
                                              unsigned long long flags)
{
    CUresult r;

    gate_enter(GATE_LAUNCH, "cuMemExportToShareableHandle");
    r = export_handle(shareableHandle, handle, handleType, flags);
    gate_leave(GATE_LAUNCH);
    return r;
}

CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                void *osHandle,
                                                CUmemAllocationHandleType shHandleType)
{
    CUresult r;

    gate_enter(GATE_LAUNCH, "cuMemImportFromShareableHandle");
    r = import_handle(handle, osHandle, shHandleType);
    gate_leave(GATE_LAUNCH);
    return r;
}
