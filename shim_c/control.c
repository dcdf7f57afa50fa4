/*
 * The control server (shared/PROTOCOL.md) and the shim's lifecycle.
 *
 * Started lazily by the first tracked call or the first successful cuInit:
 * the shim never initialises CUDA on the application's behalf. One listener
 * thread accepts; each connection gets its own short-lived thread, so a
 * peer's EXPORT is served while a phase op runs (two participants that
 * import from each other during RESTORE_UNICAST would deadlock otherwise).
 * One request per connection, bounded reads with a deadline, replies with
 * MSG_NOSIGNAL: a client that hangs up or stalls never hurts the process.
 *
 * Fork: the child drops the inherited bookkeeping in the atfork handler,
 * closes the inherited listener without unlinking the parent's socket, and
 * comes up with a fresh participant id and socket on its first tracked
 * call. A pinned id (SNAPSHOT_PARTICIPANT_ID) is claimed with a file in the
 * control dir holding the owner's pid; an exec'd child that inherits the
 * variable while the owner lives derives a fresh random id instead.
 */
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_CONNECTIONS 64

SHIM_HIDDEN struct shim_state g = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .init_lock = PTHREAD_MUTEX_INITIALIZER,
    .phase = CUIP_PHASE_ACTIVE,
    .listen_fd = -1,
};

static int connections; /* atomic */
static bool inherited_state; /* fork child: the parent had tracked state */

/* ------------------------------------------------------------ bounded I/O */
static int wait_fd(int fd, short events, uint64_t deadline)
{
    for (;;) {
        uint64_t now = shim_now_ns();
        struct pollfd p = {.fd = fd, .events = events};
        int ms, n;
        if (now >= deadline) {
            errno = ETIMEDOUT;
            return -1;
        }
        ms = (int)((deadline - now + 999999) / 1000000);
        n = poll(&p, 1, ms);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return -1;
    }
}

int io_write_all(int fd, const void *buf, size_t len, uint64_t deadline)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n;
        if (wait_fd(fd, POLLOUT, deadline) != 0)
            return -1;
        n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Read exactly `len` bytes. With fd_out, SCM_RIGHTS are accepted: the first
 * descriptor lands in *fd_out (if still -1), any other is closed. */
int io_read_all(int fd, void *buf, size_t len, uint64_t deadline, int *fd_out)
{
    char *p = buf;
    errno = 0;
    while (len > 0) {
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int) * 4)];
        } cbuf;
        struct iovec iov = {.iov_base = p, .iov_len = len};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
        ssize_t n;

        if (fd_out) {
            m.msg_control = cbuf.b;
            m.msg_controllen = sizeof cbuf.b;
        }
        if (wait_fd(fd, POLLIN, deadline) != 0)
            return -1;
        n = recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return -1;
        }
        if (fd_out) {
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
                if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                    continue;
                size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t i = 0; i < nfd; i++) {
                    int x;
                    memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof x);
                    if (*fd_out < 0)
                        *fd_out = x;
                    else
                        close(x);
                }
            }
        }
        if (n == 0) {
            errno = 0; /* peer closed */
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* ------------------------------------------------------------ replies */
void reply_msg(struct reply *r, int status, const char *fmt, ...)
{
    va_list ap;
    int n;
    r->h.status = status;
    va_start(ap, fmt);
    n = vsnprintf(r->msg, sizeof r->msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n >= sizeof r->msg)
        n = (int)sizeof r->msg - 1;
    r->h.message_length = (uint32_t)n;
}

static void reply_init(struct reply *r, uint16_t op)
{
    memset(r, 0, sizeof *r);
    r->fd = -1;
    r->h.magic = CUIP_MAGIC;
    r->h.version = CUIP_VERSION;
    r->h.op = op;
    memcpy(r->h.participant, g.participant, CUIP_PARTICIPANT_LEN);
    r->h.pid = (uint32_t)getpid();
}

static int reply_send(int s, struct reply *r, uint64_t deadline)
{
    size_t rec_bytes = (size_t)r->h.count * sizeof(struct cuip_record);
    size_t total = sizeof r->h + r->h.message_length + rec_bytes;
    char *buf = malloc(total);
    int rc = -1;

    if (!buf)
        return -1;
    memcpy(buf, &r->h, sizeof r->h);
    memcpy(buf + sizeof r->h, r->msg, r->h.message_length);
    if (rec_bytes)
        memcpy(buf + sizeof r->h + r->h.message_length, r->records, rec_bytes);
    if (r->fd >= 0) {
        /* The descriptor rides on the header's first byte. */
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int))];
        } cbuf;
        struct iovec iov = {.iov_base = buf, .iov_len = total};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf.b,
                           .msg_controllen = sizeof cbuf.b};
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        ssize_t n;
        memset(cbuf.b, 0, sizeof cbuf.b);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &r->fd, sizeof(int));
        do {
            if (wait_fd(s, POLLOUT, deadline) != 0)
                goto out;
            n = sendmsg(s, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        } while (n < 0 && (errno == EINTR || errno == EAGAIN));
        if (n < 0)
            goto out;
        rc = io_write_all(s, buf + n, total - (size_t)n, deadline);
    } else {
        rc = io_write_all(s, buf, total, deadline);
    }
out:
    free(buf);
    return rc;
}

/* ------------------------------------------------------------ requests */
static const char *op_name(unsigned op)
{
    static const char *const names[] = {
        "?", "HANDSHAKE", "INSPECT", "PREPARE_MULTICAST", "SAVE_ALLOCATIONS",
        "PREPARE_UNICAST", "LOAD_ALLOCATIONS", "RESTORE_UNICAST",
        "RESTORE_MULTICAST_CREATORS", "RESTORE_MULTICAST_IMPORTERS",
        "RESTORE_MULTICAST_DEVICES", "RESTORE_MULTICAST_BINDINGS", "EXPORT"};
    return op <= CUIP_OP_MAX ? names[op] : "?";
}

/* Strict validation: anything non-zero where zero is required, a wrong
 * magic or version, an unknown op or a foreign participant is refused. */
static bool validate(const struct cuip_header *q, struct reply *r)
{
    bool exporting = q->op == CUIP_OP_EXPORT;
    if (q->magic != CUIP_MAGIC || q->version != CUIP_VERSION) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "bad magic or version");
        return false;
    }
    if (q->op < CUIP_OP_HANDSHAKE || q->op > CUIP_OP_MAX) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "unknown op %u", q->op);
        return false;
    }
    if (q->status || q->count || q->message_length || q->pid || q->phase || q->reserved ||
        q->stat_count || q->stat_bytes || q->stat_elapsed_ns || q->stat_copy_ns) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "%s request has reply-only fields set",
                  op_name(q->op));
        return false;
    }
    if (exporting) {
        if ((q->resource_kind != CUIP_RESOURCE_UNICAST &&
             q->resource_kind != CUIP_RESOURCE_MULTICAST) ||
            shim_is_zero(q->resource_id, CUIP_ID_LEN)) {
            reply_msg(r, CUIP_STATUS_BAD_REQUEST, "EXPORT needs a resource kind and id");
            return false;
        }
    } else if (!shim_is_zero(q->resource_id, CUIP_ID_LEN) ||
               !shim_is_zero(q->authorization, CUIP_AUTH_LEN) || q->resource_kind) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "%s request carries EXPORT-only fields",
                  op_name(q->op));
        return false;
    }
    if (q->op == CUIP_OP_HANDSHAKE) {
        if (!shim_is_zero(q->participant, CUIP_PARTICIPANT_LEN)) {
            reply_msg(r, CUIP_STATUS_BAD_REQUEST, "HANDSHAKE must not name a participant");
            return false;
        }
        return true;
    }
    if (!shim_is_participant(q->participant)) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "participant is not 32 lowercase hex digits");
        return false;
    }
    if (memcmp(q->participant, g.participant, CUIP_PARTICIPANT_LEN)) {
        reply_msg(r, CUIP_STATUS_WRONG_PARTICIPANT, "this shim is participant %s",
                  g.participant);
        return false;
    }
    return true;
}

struct phase_op {
    uint16_t need, next;
    int (*run)(struct reply *);
    bool stats;
};

static int noop(struct reply *r)
{
    (void)r;
    return 0;
}

static const struct phase_op phase_ops[CUIP_OP_MAX + 1] = {
    [CUIP_OP_PREPARE_MULTICAST] = {CUIP_PHASE_ACTIVE, CUIP_PHASE_MULTICAST_DETACHED,
                                   multicast_prepare, false},
    [CUIP_OP_SAVE_ALLOCATIONS] = {CUIP_PHASE_MULTICAST_DETACHED, CUIP_PHASE_ALLOCATIONS_SAVED,
                                  content_save, true},
    [CUIP_OP_PREPARE_UNICAST] = {CUIP_PHASE_ALLOCATIONS_SAVED, CUIP_PHASE_PREPARED,
                                 unicast_prepare, false},
    [CUIP_OP_LOAD_ALLOCATIONS] = {CUIP_PHASE_PREPARED, CUIP_PHASE_ALLOCATIONS_LOADED,
                                  content_load, true},
    [CUIP_OP_RESTORE_UNICAST] = {CUIP_PHASE_ALLOCATIONS_LOADED, CUIP_PHASE_UNICAST_RESTORED,
                                 unicast_restore, false},
    [CUIP_OP_RESTORE_MULTICAST_CREATORS] = {CUIP_PHASE_UNICAST_RESTORED,
                                            CUIP_PHASE_MULTICAST_CREATED, noop, false},
    [CUIP_OP_RESTORE_MULTICAST_IMPORTERS] = {CUIP_PHASE_MULTICAST_CREATED,
                                             CUIP_PHASE_MULTICAST_IMPORTED, noop, false},
    [CUIP_OP_RESTORE_MULTICAST_DEVICES] = {CUIP_PHASE_MULTICAST_IMPORTED,
                                           CUIP_PHASE_MULTICAST_JOINED, noop, false},
    [CUIP_OP_RESTORE_MULTICAST_BINDINGS] = {CUIP_PHASE_MULTICAST_JOINED, CUIP_PHASE_ACTIVE, noop,
                                            false},
};

/* Run one phase op. The phase leaves ACTIVE before any work, so the
 * application's tracked calls see NOT_READY from then on; g.lock is not
 * held while the op works (copies block, RESTORE_UNICAST calls peers). */
static void run_phase_op(uint16_t op, struct reply *r)
{
    const struct phase_op *d = &phase_ops[op];
    uint64_t t0 = shim_now_ns();
    int rc;

    pthread_mutex_lock(&g.lock);
    if (g.busy) {
        reply_msg(r, CUIP_STATUS_REFUSED, "another phase op is running");
        pthread_mutex_unlock(&g.lock);
        return;
    }
    if (g.phase != d->need) {
        reply_msg(r, CUIP_STATUS_WRONG_PHASE, "%s needs phase %u; the shim is in phase %u",
                  op_name(op), d->need, g.phase);
        pthread_mutex_unlock(&g.lock);
        return;
    }
    g.busy = true;
    if (d->need == CUIP_PHASE_ACTIVE)
        g.phase = d->next;
    pthread_mutex_unlock(&g.lock);

    rc = d->run(r);

    pthread_mutex_lock(&g.lock);
    if (rc == 0) {
        g.phase = d->next;
        r->h.status = CUIP_STATUS_OK;
        if (d->stats)
            r->h.stat_elapsed_ns = shim_now_ns() - t0;
        shim_log(LOG_INFO, "%s done: phase %u", op_name(op), g.phase);
    } else if (rc == -2) {
        g.phase = d->need; /* refused before doing anything */
    } else {
        /* Fail-stop: no rollback. */
        g.phase = CUIP_PHASE_FAILED;
        snprintf(g.reason, sizeof g.reason, "%s", r->h.message_length ? r->msg : op_name(op));
        if (!r->h.status)
            reply_msg(r, CUIP_STATUS_INTERNAL, "%s failed", op_name(op));
        shim_log(LOG_ERROR, "%s failed: %s", op_name(op), g.reason);
    }
    g.busy = false;
    pthread_mutex_unlock(&g.lock);
}

static void handle(const struct cuip_header *q, struct reply *r)
{
    if (!validate(q, r))
        return;
    switch (q->op) {
    case CUIP_OP_HANDSHAKE:
        pthread_mutex_lock(&g.lock);
        if (g.phase == CUIP_PHASE_FAILED)
            reply_msg(r, CUIP_STATUS_OK, "%s", g.reason);
        pthread_mutex_unlock(&g.lock);
        return;
    case CUIP_OP_INSPECT:
        pthread_mutex_lock(&g.lock);
        if (g.phase != CUIP_PHASE_ACTIVE)
            reply_msg(r, CUIP_STATUS_WRONG_PHASE, "INSPECT needs phase ACTIVE; the shim is in "
                      "phase %u", g.phase);
        else if (g.busy)
            reply_msg(r, CUIP_STATUS_REFUSED, "another phase op is running");
        else
            unicast_inspect(r);
        pthread_mutex_unlock(&g.lock);
        return;
    case CUIP_OP_EXPORT:
        cap_serve_export(q, r);
        return;
    default:
        run_phase_op(q->op, r);
        return;
    }
}

/* ------------------------------------------------------------ connections */
static void *conn_main(void *arg)
{
    int s = (int)(intptr_t)arg;
    struct ucred cr;
    socklen_t cl = sizeof cr;
    struct cuip_header q;
    struct reply *r = NULL;
    uint64_t deadline = shim_now_ns() + (uint64_t)g.io_timeout_ms * 1000000ull;

    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0 ||
        (cr.uid != 0 && cr.uid != getuid())) {
        shim_log(LOG_WARN, "control connection from uid %d refused", (int)cr.uid);
        goto out;
    }
    if (io_read_all(s, &q, sizeof q, deadline, NULL) != 0)
        goto out; /* truncated, stalled or hung up: drop it */
    r = malloc(sizeof *r);
    if (!r)
        goto out;
    reply_init(r, q.op);
    handle(&q, r);
    pthread_mutex_lock(&g.lock);
    r->h.phase = g.phase;
    pthread_mutex_unlock(&g.lock);
    if (r->h.status != CUIP_STATUS_OK)
        shim_log(LOG_DEBUG, "%s answered status %d: %.*s", op_name(q.op), r->h.status,
                 (int)r->h.message_length, r->msg);
    deadline = shim_now_ns() + (uint64_t)g.io_timeout_ms * 1000000ull;
    if (reply_send(s, r, deadline) != 0)
        shim_log(LOG_DEBUG, "reply to %s not delivered: %s", op_name(q.op), strerror(errno));
out:
    if (r) {
        if (r->fd >= 0)
            close(r->fd);
        free(r->records);
        free(r);
    }
    close(s);
    __atomic_sub_fetch(&connections, 1, __ATOMIC_RELAXED);
    return NULL;
}

static void *listen_main(void *arg)
{
    int lfd = (int)(intptr_t)arg;
    for (;;) {
        pthread_t t;
        pthread_attr_t at;
        int s = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (s < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS) {
                usleep(10000);
                continue;
            }
            shim_log(LOG_ERROR, "accept failed: %s; control server stops", strerror(errno));
            return NULL;
        }
        if (__atomic_add_fetch(&connections, 1, __ATOMIC_RELAXED) > MAX_CONNECTIONS) {
            close(s); /* a flood: drop, the coordinator retries or fails */
            __atomic_sub_fetch(&connections, 1, __ATOMIC_RELAXED);
            continue;
        }
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &at, conn_main, (void *)(intptr_t)s) != 0) {
            close(s);
            __atomic_sub_fetch(&connections, 1, __ATOMIC_RELAXED);
        }
        pthread_attr_destroy(&at);
    }
    return NULL;
}

/* ------------------------------------------------------------ startup */
static bool control_dir_init(void)
{
    const char *d = getenv(CUIP_CONTROL_DIR_ENV);
    struct stat st;

    if (!d || !*d)
        d = CUIP_CONTROL_DIR_DEFAULT;
    /* Room for "/cuinterpose-<pid>.sock" and the temporary name. */
    if (d[0] != '/' || strlen(d) + 48 >= sizeof g.control_dir) {
        shim_log(LOG_ERROR, "%s=%s must be an absolute path of at most %zu bytes",
                 CUIP_CONTROL_DIR_ENV, d, sizeof g.control_dir - 48);
        return false;
    }
    snprintf(g.control_dir, sizeof g.control_dir, "%s", d);
    if (mkdir(g.control_dir, 0700) != 0 && errno != EEXIST) {
        shim_log(LOG_ERROR, "cannot create control directory %s: %s", g.control_dir,
                 strerror(errno));
        g.control_dir[0] = 0;
        return false;
    }
    if (stat(g.control_dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        shim_log(LOG_ERROR, "control directory %s is not a directory", g.control_dir);
        g.control_dir[0] = 0;
        return false;
    }
    return true;
}

/* The claim on a pinned id: a file holding the owner's pid. */
static bool claim_pin(const char *id)
{
    char buf[32];
    int fd, len;

    if (!g.control_dir[0])
        return true; /* no control dir: nobody can see the id anyway */
    snprintf(g.claim_path, sizeof g.claim_path, "%s/.cuinterpose-id-%s", g.control_dir, id);
    for (int attempt = 0; attempt < 2; attempt++) {
        fd = open(g.claim_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0) {
            len = snprintf(buf, sizeof buf, "%d\n", (int)getpid());
            if (write(fd, buf, (size_t)len) != len) {
                close(fd);
                unlink(g.claim_path);
                break;
            }
            close(fd);
            return true;
        }
        if (errno != EEXIST)
            break;
        fd = open(g.claim_path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            ssize_t n = read(fd, buf, sizeof buf - 1);
            long owner;
            close(fd);
            buf[n > 0 ? n : 0] = 0;
            owner = strtol(buf, NULL, 10);
            if (owner == getpid())
                return true;
            if (owner > 0 && (kill((pid_t)owner, 0) == 0 || errno == EPERM)) {
                shim_log(LOG_WARN, "participant id %s is held by live pid %ld: this process "
                         "derives a fresh id", id, owner);
                g.claim_path[0] = 0;
                return false;
            }
        }
        unlink(g.claim_path); /* stale: its owner is gone */
    }
    g.claim_path[0] = 0;
    return false;
}

static void participant_init(bool fork_child)
{
    const char *pin = getenv(CUIP_PARTICIPANT_ENV);
    uint8_t raw[CUIP_PARTICIPANT_LEN / 2];

    g.pinned = false;
    g.claim_path[0] = 0;
    if (pin && *pin) {
        if (fork_child)
            shim_log(LOG_INFO, "fork child: not reusing the pinned participant id");
        else if (strlen(pin) != CUIP_PARTICIPANT_LEN || !shim_is_participant(pin))
            shim_log(LOG_WARN, "%s is not 32 lowercase hex digits; ignored",
                     CUIP_PARTICIPANT_ENV);
        else if (claim_pin(pin)) {
            memcpy(g.participant, pin, CUIP_PARTICIPANT_LEN);
            g.participant[CUIP_PARTICIPANT_LEN] = 0;
            g.pinned = true;
            return;
        }
    }
    shim_random_id(raw);
    shim_hex(g.participant, raw, sizeof raw);
    g.participant[CUIP_PARTICIPANT_LEN] = 0;
}

static int listener_create(void)
{
    struct sockaddr_un a;
    char tmp[sizeof a.sun_path];
    uint8_t rnd[4];
    char rhex[9];
    int fd, n;

    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    snprintf(g.sock_name, sizeof g.sock_name, "%s%d%s", CUIP_SOCKET_PREFIX, (int)getpid(),
             CUIP_SOCKET_SUFFIX);
    n = snprintf(g.sock_path, sizeof g.sock_path, "%s/%s", g.control_dir, g.sock_name);
    if (n < 0 || (size_t)n >= sizeof a.sun_path)
        goto fail_name;
    if (shim_random(rnd, sizeof rnd) != 0)
        memset(rnd, 0, sizeof rnd);
    shim_hex(rhex, rnd, sizeof rnd);
    rhex[8] = 0;
    n = snprintf(tmp, sizeof tmp, "%s/.cuinterpose-%d.%s.tmp", g.control_dir, (int)getpid(),
                 rhex);
    if (n < 0 || (size_t)n >= sizeof tmp)
        goto fail_name;
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        shim_log(LOG_ERROR, "socket: %s", strerror(errno));
        goto fail;
    }
    /* Bind under a temporary name, restrict it to 0600, then rename: no
     * client ever sees the socket with the umask's mode. */
    memcpy(a.sun_path, tmp, strlen(tmp) + 1);
    unlink(tmp);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || chmod(tmp, 0600) != 0 ||
        listen(fd, 64) != 0 || rename(tmp, g.sock_path) != 0) {
        shim_log(LOG_ERROR, "control socket %s: %s", g.sock_path, strerror(errno));
        unlink(tmp);
        close(fd);
        goto fail;
    }
    return fd;
fail_name:
    shim_log(LOG_ERROR, "control socket path too long in %s", g.control_dir);
fail:
    g.sock_name[0] = 0;
    g.sock_path[0] = 0;
    return -1;
}

/* Our threads take no signals: the application's handlers run on its own
 * threads, as they would without the shim. */
static int start_thread(void *(*fn)(void *), void *arg)
{
    sigset_t all, old;
    pthread_t t;
    pthread_attr_t at;
    int rc;

    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&t, &at, fn, arg);
    pthread_attr_destroy(&at);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

static bool fork_child_flag;

static bool content_mode_native(void)
{
    const char *v = getenv("SNAPSHOT_CONTENT_MODE");
    if (!v || !*v || !strcmp(v, "host"))
        return false;
    if (!strcmp(v, "native"))
        return true;
    shim_log(LOG_WARN, "SNAPSHOT_CONTENT_MODE=%s is neither host nor native; using host", v);
    return false;
}

void shim_ensure_started(void)
{
    pid_t me = getpid();
    if (__atomic_load_n(&g.started_pid, __ATOMIC_ACQUIRE) == me)
        return;
    pthread_mutex_lock(&g.init_lock);
    if (g.started_pid != me) {
        /* The coordinator's SNAPSHOT_PHASE_TIMEOUT_S (120 s) must exceed the
         * peer-export timeout, or its wait expires with ours. */
        g.io_timeout_ms = shim_env_seconds_ms("SNAPSHOT_SHIM_IO_TIMEOUT_S", 5000);
        g.peer_timeout_ms = shim_env_seconds_ms("SNAPSHOT_PEER_TIMEOUT_S", 10000);
        g.native_content = content_mode_native();
        control_dir_init();
        pthread_mutex_lock(&g.lock);
        participant_init(fork_child_flag);
        pthread_mutex_unlock(&g.lock);
        if (g.control_dir[0]) {
            int fd = listener_create();
            if (fd >= 0) {
                g.listen_fd = fd;
                if (start_thread(listen_main, (void *)(intptr_t)fd) != 0) {
                    shim_log(LOG_ERROR, "cannot start the control thread");
                    unlink(g.sock_path);
                    close(fd);
                    g.listen_fd = -1;
                    g.sock_name[0] = 0;
                }
            }
        }
        if (g.listen_fd < 0)
            shim_log(LOG_WARN, "no control server: this process cannot be checkpointed with "
                     "cuinterpose");
        else
            shim_log(LOG_INFO, "participant %s listening on %s", g.participant, g.sock_path);
        if (inherited_state)
            shim_log(LOG_WARN, "forked after CUDA state existed: unsupported; the child starts "
                     "with an empty topology");
        __atomic_store_n(&g.started_pid, me, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g.init_lock);
}

CUresult shim_enter(void)
{
    if (!shim_resolve_real())
        return CUDA_ERROR_NOT_INITIALIZED;
    shim_ensure_started();
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ fork and exit */
static void atfork_child(void)
{
    /* Only this thread survives: the locks may have been held by threads
     * that no longer exist. */
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&g.lock, &fresh, sizeof fresh);
    memcpy(&g.init_lock, &fresh, sizeof fresh);
    inherited_state = obj_count() > 0;
    obj_drop_all();
    if (g.listen_fd >= 0)
        close(g.listen_fd); /* the parent's socket file stays: it is the parent's */
    g.listen_fd = -1;
    g.started_pid = 0;
    g.phase = CUIP_PHASE_ACTIVE;
    g.busy = false;
    g.reason[0] = 0;
    g.sock_name[0] = 0;
    g.sock_path[0] = 0;
    g.claim_path[0] = 0;
    memset(g.participant, 0, sizeof g.participant);
    connections = 0;
    fork_child_flag = true;
}

__attribute__((constructor)) static void shim_init(void)
{
    pthread_atfork(NULL, NULL, atfork_child);
}

__attribute__((destructor)) static void shim_fini(void)
{
    if (g.started_pid != getpid())
        return;
    if (g.sock_path[0])
        unlink(g.sock_path);
    if (g.claim_path[0])
        unlink(g.claim_path);
}
