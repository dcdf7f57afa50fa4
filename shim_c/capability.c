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
    if (c->version != CUIP_CAP_VERSION || c->resource_kind != CUIP_RESOURCE_UNICAST ||
        !shim_is_participant(c->creator) || shim_is_zero(c->resource_id, CUIP_ID_LEN) ||
        !endpoint_ok(c->endpoint) || c->size == 0)
        return CAP_MALFORMED;
    return CAP_VALID;
}

/* ------------------------------------------------------------ peer client */
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
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(msg, n, "socket: %s", strerror(errno));
        return -1;
    }
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int gone = errno == ECONNREFUSED || errno == ENOENT;
        snprintf(msg, n, "connect %s: %s", a.sun_path, strerror(errno));
        close(fd);
        return gone ? CAP_CREATOR_GONE : -1;
    }
    return fd;
}

int cap_fetch(const char creator[CUIP_PARTICIPANT_LEN], const uint8_t id[CUIP_ID_LEN],
              const uint8_t auth[CUIP_AUTH_LEN], const char endpoint[CUIP_CAP_ENDPOINT_LEN],
              char *msg, size_t n)
{
    struct cuip_header req, rep;
    uint64_t deadline = shim_now_ns() + (uint64_t)shim_settings()->peer_timeout_ms * 1000000ull;
    int s, got = -1, extra = -1;
    char text[CUIP_MESSAGE_MAX + 1];

    if (!g.control_dir[0]) {
        snprintf(msg, n, "no control directory: cannot reach the creator");
        return -1;
    }
    s = connect_endpoint(endpoint, msg, n);
    if (s < 0)
        return s;
    memset(&req, 0, sizeof req);
    req.magic = CUIP_MAGIC;
    req.version = CUIP_VERSION;
    req.op = CUIP_OP_EXPORT;
    memcpy(req.participant, creator, CUIP_PARTICIPANT_LEN);
    memcpy(req.resource_id, id, CUIP_ID_LEN);
    memcpy(req.authorization, auth, CUIP_AUTH_LEN);
    req.resource_kind = CUIP_RESOURCE_UNICAST;
    if (io_write_all(s, &req, sizeof req, deadline) != 0) {
        snprintf(msg, n, "EXPORT request to %.*s: %s", CUIP_CAP_ENDPOINT_LEN, endpoint,
                 strerror(errno));
        goto fail;
    }
    if (io_read_all(s, &rep, sizeof rep, deadline, &got) != 0) {
        snprintf(msg, n, "EXPORT reply from %.*s: %s", CUIP_CAP_ENDPOINT_LEN, endpoint,
                 errno ? strerror(errno) : "connection closed");
        goto fail;
    }
    if (rep.magic != CUIP_MAGIC || rep.version != CUIP_VERSION || rep.op != CUIP_OP_EXPORT ||
        memcmp(rep.participant, creator, CUIP_PARTICIPANT_LEN) ||
        rep.message_length > CUIP_MESSAGE_MAX || rep.count != 0) {
        snprintf(msg, n, "malformed EXPORT reply from %.*s", CUIP_CAP_ENDPOINT_LEN, endpoint);
        goto fail;
    }
    memset(text, 0, sizeof text);
    if (rep.message_length &&
        io_read_all(s, text, rep.message_length, deadline, got < 0 ? &got : &extra) != 0) {
        snprintf(msg, n, "truncated EXPORT reply from %.*s", CUIP_CAP_ENDPOINT_LEN, endpoint);
        goto fail;
    }
    if (rep.status != CUIP_STATUS_OK) {
        snprintf(msg, n, "creator %.*s refused EXPORT (status %d): %s", CUIP_PARTICIPANT_LEN,
                 creator, rep.status, text);
        goto fail;
    }
    if (got < 0) {
        snprintf(msg, n, "EXPORT reply from %.*s carried no file descriptor",
                 CUIP_CAP_ENDPOINT_LEN, endpoint);
        goto fail;
    }
    if (extra >= 0)
        close(extra);
    close(s);
    return got;
fail:
    if (got >= 0)
        close(got);
    if (extra >= 0)
        close(extra);
    close(s);
    return -1;
}

/* ------------------------------------------------------------ EXPORT server */
/* Where a creator's allocations are live again for its importers: ACTIVE,
 * every restore phase, and ROLLBACK_LOADED (importers re-import then). */
static bool export_phase_ok(uint16_t p)
{
    return p == CUIP_PHASE_ACTIVE || p == CUIP_PHASE_ROLLBACK_LOADED ||
           (p >= CUIP_PHASE_ALLOCATIONS_LOADED && p <= CUIP_PHASE_MULTICAST_JOINED);
}

void cap_serve_export(const struct cuip_header *req, struct reply *r)
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
    if (req->resource_kind != CUIP_RESOURCE_UNICAST) {
        reply_msg(r, CUIP_STATUS_NOT_FOUND, "multicast export is not supported yet");
        goto out;
    }
    o = obj_by_id(req->resource_id);
    if (!o || o->kind != OBJ_ALLOC || !o->is_creator || !o->has_auth || obj_unused(o)) {
        reply_msg(r, CUIP_STATUS_NOT_FOUND, "no exported allocation with that id");
        goto out;
    }
    if (!shim_ct_equal(o->auth, req->authorization, CUIP_AUTH_LEN)) {
        reply_msg(r, CUIP_STATUS_UNAUTHORIZED, "bad authorization");
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
    r->fd = fd;
    r->h.status = CUIP_STATUS_OK;
out:
    pthread_mutex_unlock(&g.lock);
}

/* ------------------------------------------------------------ application calls */
CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle,
                                              CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType handleType,
                                              unsigned long long flags)
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
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || o->kind != OBJ_ALLOC ||
        o->raw_import || !shareableHandle || !g.sock_name[0]) {
        /* Not something a capability stands for (other handle types,
         * multicast, raw imports, or no control server): the driver's own
         * answer; INSPECT reports these so capture refuses. */
        if (handleType == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && o->kind == OBJ_ALLOC &&
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
    if (o->kind != OBJ_ALLOC || !o->has_auth || obj_unused(o) || !o->live ||
        !shim_ct_equal(o->auth, c->authorization, CUIP_AUTH_LEN)) {
        *r = CUDA_ERROR_INVALID_VALUE;
        return true;
    }
    o->refs++;
    *handle = obj_handle(o);
    *r = CUDA_SUCCESS;
    return true;
}

static CUresult import_cap(CUmemGenericAllocationHandle *handle, const struct cuip_capability *c)
{
    CUmemGenericAllocationHandle h;
    struct obj *o;
    char msg[512];
    CUresult r;
    int fd;

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

    /* The peer request runs without g.lock: the creator may be asking us
     * for an export at the same time. */
    fd = cap_fetch(c->creator, c->resource_id, c->authorization, c->endpoint, msg, sizeof msg);
    if (fd < 0) {
        shim_log(LOG_WARN, "import of a capability failed: %s", msg);
        return CUDA_ERROR_INVALID_VALUE;
    }
    r = real.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (r != CUDA_SUCCESS)
        return r;
    if (SHIM_IS_TAGGED(h)) {
        real.cuMemRelease(h);
        return CUDA_ERROR_NOT_SUPPORTED;
    }

    pthread_mutex_lock(&g.lock);
    if (g.phase != CUIP_PHASE_ACTIVE) {
        real.cuMemRelease(h);
        r = CUDA_ERROR_NOT_READY;
        goto out;
    }
    if (reuse_known(c, handle, &r)) {
        /* Another thread imported it meanwhile. */
        real.cuMemRelease(h);
        goto out;
    }
    o = obj_adopt(OBJ_ALLOC, h);
    if (!o) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    memcpy(o->id, c->resource_id, CUIP_ID_LEN);
    memcpy(o->creator, c->creator, CUIP_PARTICIPANT_LEN);
    memcpy(o->auth, c->authorization, CUIP_AUTH_LEN);
    memcpy(o->endpoint, c->endpoint, CUIP_CAP_ENDPOINT_LEN);
    o->has_auth = true;
    o->imported = true;
    o->size = c->size;
    o->handle_types = c->handle_types;
    if (real.cuMemGetAllocationPropertiesFromHandle(&o->prop, h) != CUDA_SUCCESS)
        memset(&o->prop, 0, sizeof o->prop);
    o->prop.win32HandleMetaData = NULL;
    o->prop.requestedHandleTypes = (CUmemAllocationHandleType)c->handle_types;
    *handle = obj_handle(o);
    r = CUDA_SUCCESS;
out:
    pthread_mutex_unlock(&g.lock);
    return r;
}

CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                void *osHandle,
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
