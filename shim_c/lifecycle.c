/*
 * The shim's lifecycle: becoming a participant (control directory, id,
 * listening socket, listener thread), fork, exit.
 *
 * The start is registered with state.c from the constructor and runs once
 * per process, on the first tracked call or the first successful cuInit.
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
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

static bool inherited_state; /* fork child: the parent had tracked state */
static bool fork_child_flag;

/* ------------------------------------------------------------ startup */
/* Whoever can write the control dir can put a socket of theirs under a
 * participant's name (and receive its EXPORT requests and capabilities'
 * imports) or a symlink where our socket goes: the dir must be a real
 * directory, owned by root or us, writable by nobody else. Its parents
 * are the operator's business. Refused: logged, and nothing is served. */
static bool control_dir_trusted(const struct stat *st, const char *path)
{
    const char *why = NULL;

    if (S_ISLNK(st->st_mode))
        why = "is a symbolic link";
    else if (!S_ISDIR(st->st_mode))
        why = "is not a directory";
    else if (!shim_trusted_uid(st->st_uid))
        why = "is owned by another user";
    else if (st->st_mode & (S_IWGRP | S_IWOTH))
        why = "is writable by group or others";
    if (!why)
        return true;
    shim_log(LOG_ERROR, "control directory %s %s (uid %d, mode %04o): refused, no control "
             "server; this process cannot be checkpointed with cuinterpose%s",
             path, why, (int)st->st_uid, (unsigned)(st->st_mode & 07777),
             (st->st_mode & (S_IWGRP | S_IWOTH)) ? " (chmod 700 it)" : "");
    return false;
}

static bool control_dir_init(void)
{
    const char *d = shim_settings()->control_dir;
    struct stat st;

    /* Room for "/cuinterpose-<pid>.sock" and the temporary name (protocol.h). */
    _Static_assert(CUIP_CONTROL_DIR_MAX < sizeof g.control_dir, "the limit fits");
    if (d[0] != '/' || strlen(d) > CUIP_CONTROL_DIR_MAX) {
        shim_log(LOG_ERROR, "%s=%s must be an absolute path of at most %u bytes (a socket "
                 "path is at most 107 bytes, and the names bound in it take up to 37); no "
                 "control server", CUIP_CONTROL_DIR_ENV, d, CUIP_CONTROL_DIR_MAX);
        return false;
    }
    memcpy(g.control_dir, d, strlen(d) + 1); /* fits: checked above */
    if (mkdir(g.control_dir, 0700) != 0 && errno != EEXIST) {
        shim_log(LOG_ERROR, "cannot create control directory %s: %s", g.control_dir,
                 strerror(errno));
        g.control_dir[0] = 0;
        return false;
    }
    if (lstat(g.control_dir, &st) != 0) {
        shim_log(LOG_ERROR, "control directory %s: %s", g.control_dir, strerror(errno));
        g.control_dir[0] = 0;
        return false;
    }
    if (!control_dir_trusted(&st, g.control_dir)) {
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
    const char *pin = shim_settings()->participant;
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

/* The endpoint as published, which endpoint_heal compares the control dir
 * with. Set by start() before the listener thread exists, then only by that
 * thread. */
static struct {
    pid_t pid;                      /* getpid() when published */
    dev_t dev;                      /* the socket file at g.sock_path */
    ino_t ino;
    ino_t sock_ino;                 /* the listening socket itself (sockfs) */
    char bind_path[sizeof g.sock_path]; /* the name it was bound at */
} published;

/* Set (under g.lock) by shim_fini: the process exits, the endpoint stays gone. */
static bool exiting;

/* A listening socket at `<control dir>/cuinterpose-<pid>.sock`, names and
 * identity in `*name`, `*path` and `published` (committed by the caller);
 * -1 when it cannot be made (logged). */
static int listener_create_at(char *name, size_t name_len, char *path)
{
    struct sockaddr_un a;
    char tmp[sizeof a.sun_path];
    uint8_t rnd[4];
    char rhex[9];
    struct stat st;
    int fd, n;

    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    snprintf(name, name_len, "%s%d%s", CUIP_SOCKET_PREFIX, (int)getpid(), CUIP_SOCKET_SUFFIX);
    n = snprintf(path, sizeof g.sock_path, "%s/%s", g.control_dir, name);
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
    /* Non-blocking: the listener polls, and may swap sockets between the
     * poll and the accept (endpoint_heal). */
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        shim_log(LOG_ERROR, "socket: %s", strerror(errno));
        return -1;
    }
    /* Bind under a temporary name, restrict it to 0600, then rename: no
     * client ever sees the socket with the umask's mode. */
    memcpy(a.sun_path, tmp, strlen(tmp) + 1);
    unlink(tmp);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || chmod(tmp, 0600) != 0 ||
        listen(fd, 64) != 0 || rename(tmp, path) != 0 || lstat(path, &st) != 0) {
        shim_log(LOG_ERROR, "control socket %s: %s", path, strerror(errno));
        unlink(tmp);
        close(fd);
        return -1;
    }
    published.pid = getpid();
    published.dev = st.st_dev;
    published.ino = st.st_ino;
    published.sock_ino = fstat(fd, &st) == 0 ? st.st_ino : 0;
    memcpy(published.bind_path, tmp, strlen(tmp) + 1);
    return fd;
fail_name:
    shim_log(LOG_ERROR, "control socket path too long in %s", g.control_dir);
    return -1;
}

static int listener_create(void)
{
    int fd = listener_create_at(g.sock_name, sizeof g.sock_name, g.sock_path);
    if (fd < 0) {
        g.sock_name[0] = 0;
        g.sock_path[0] = 0;
    }
    return fd;
}

/* ------------------------------------------------------------ healing */
/* Why the published path no longer leads to the listener `lfd`, or NULL:
 * the file is gone or another one (a cleanup, a restarted container's
 * tmpfs, a foreign file), the socket is a new one (CRIU re-created it at
 * its bind name, the .tmp path), or the pid changed (a restore under
 * another pid: the name carries the pid). */
static const char *endpoint_problem(int lfd)
{
    struct stat st;

    if (getpid() != published.pid)
        return "the process id changed (restored under another pid)";
    if (fstat(lfd, &st) != 0 || st.st_ino != published.sock_ino)
        return "the listening socket is a new one (restored)";
    if (lstat(g.sock_path, &st) != 0)
        return errno == ENOENT ? "the socket file is gone" : "the socket file cannot be read";
    if (!S_ISSOCK(st.st_mode) || st.st_dev != published.dev || st.st_ino != published.ino)
        return "the socket file was replaced";
    return NULL;
}

/* The control dir, re-created when it is gone, and trusted as at start. */
static bool control_dir_ready(void)
{
    struct stat st;

    if (mkdir(g.control_dir, 0700) != 0 && errno != EEXIST) {
        shim_log(LOG_ERROR, "cannot re-create control directory %s: %s", g.control_dir,
                 strerror(errno));
        return false;
    }
    if (lstat(g.control_dir, &st) != 0) {
        shim_log(LOG_ERROR, "control directory %s: %s", g.control_dir, strerror(errno));
        return false;
    }
    return control_dir_trusted(&st, g.control_dir);
}

/* The pinned id's claim, written again when its file went with the
 * directory (a restored process keeps its id, and the claim says so). */
static void claim_heal(void)
{
    struct stat st;

    if (g.pinned && g.claim_path[0] && lstat(g.claim_path, &st) != 0 && errno == ENOENT &&
        !claim_pin(g.participant))
        shim_log(LOG_WARN, "the claim on participant id %s could not be written again",
                 g.participant);
}

/* Run by the listener thread at least every CONTROL_HEAL_MS (control.c):
 * whenever the published path no longer leads to `lfd`, a new listener is
 * made as at start (a fresh temporary name, mode 0600, renamed over the
 * path) and returned; the caller drains and closes the old one. Otherwise,
 * or when healing fails (retried at the next check), `lfd`. */
static int endpoint_heal(int lfd)
{
    static const char *reported; /* a failing heal is logged once per cause */
    const char *why = endpoint_problem(lfd);
    char name[sizeof g.sock_name], path[sizeof g.sock_path], old_bind[sizeof g.sock_path];
    pid_t old_pid = published.pid;
    int fd;

    if (!why || __atomic_load_n(&exiting, __ATOMIC_ACQUIRE)) {
        reported = NULL;
        return lfd;
    }
    if (!control_dir_ready())
        goto fail;
    memcpy(old_bind, published.bind_path, sizeof old_bind);
    fd = listener_create_at(name, sizeof name, path);
    if (fd < 0)
        goto fail;
    /* Where CRIU re-bound the old socket; a name with our pid and a random
     * part in a directory nobody else writes, so it is ours to remove. */
    if (strcmp(old_bind, published.bind_path) != 0)
        unlink(old_bind);
    pthread_mutex_lock(&g.lock);
    if (exiting) {
        /* shim_fini removed the socket file: that is no problem to heal. */
        pthread_mutex_unlock(&g.lock);
        unlink(path);
        close(fd);
        return lfd;
    }
    memcpy(g.sock_name, name, sizeof name);
    memcpy(g.sock_path, path, sizeof path);
    __atomic_store_n(&g.listen_fd, fd, __ATOMIC_RELAXED);
    claim_heal(); /* g.claim_path is g.lock's, as at start (participant_init) */
    pthread_mutex_unlock(&g.lock);
    if (old_pid != published.pid) {
        /* Not a fork (a fork child has no listener thread): this process
         * carries on under its new pid, and must not start again. */
        pthread_mutex_lock(&g.init_lock);
        __atomic_store_n(&g.started_pid, published.pid, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&g.init_lock);
    }
    /* Expected after every CRIU restore (a new pid, the socket re-published): the
     * application's stderr is the workload's, so only SNAPSHOT_SHIM_DEBUG says it. */
    shim_log(LOG_DEBUG, "control endpoint healed: %s; listening on %s again", why, path);
    reported = NULL;
    return fd;
fail:
    if (reported != why)
        shim_log(LOG_ERROR, "control endpoint %s: %s, and it cannot be re-created now; "
                 "retried every %d ms", g.sock_path, why, CONTROL_HEAL_MS);
    reported = why;
    return lfd;
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

/* Under g.init_lock (state.c), once per process. */
static void start(void)
{
    if (g.listen_fd >= 0) {
        /* A listener thread runs (a fork child has none): the process was
         * restored under another pid; that thread heals the endpoint. */
        shim_log(LOG_WARN, "running under a new pid %d: the endpoint follows it",
                 (int)getpid());
        return;
    }
    control_dir_init();
    pthread_mutex_lock(&g.lock);
    participant_init(fork_child_flag);
    pthread_mutex_unlock(&g.lock);
    if (g.control_dir[0]) {
        int fd = listener_create();
        if (fd >= 0) {
            g.listen_fd = fd;
            control_set_heal(endpoint_heal);
            if (start_thread(control_listen, (void *)(intptr_t)fd) != 0) {
                shim_log(LOG_ERROR, "cannot start the control thread");
                unlink(g.sock_path);
                close(fd);
                g.listen_fd = -1;
                g.sock_name[0] = 0;
            }
        }
    }
    if (g.listen_fd >= 0)
        keep_start();
    if (g.listen_fd < 0)
        shim_log(LOG_WARN, "no control server: this process cannot be checkpointed with "
                 "cuinterpose");
    else
        shim_log(LOG_INFO, "participant %s listening on %s", g.participant, g.sock_path);
    if (inherited_state)
        shim_log(LOG_WARN, "forked after CUDA state existed: unsupported; the child starts "
                 "with an empty topology");
}

/* ------------------------------------------------------------ fork and exit */
static void atfork_child(void)
{
    shim_state_after_fork();
    inherited_state = obj_count() > 0;
    obj_drop_all();
    owned_after_fork();
    unowned_after_fork();
    keep_after_fork();
    if (g.listen_fd >= 0)
        close(g.listen_fd); /* the parent's socket file stays: it is the parent's */
    g.listen_fd = -1;
    g.sock_name[0] = 0;
    g.sock_path[0] = 0;
    g.claim_path[0] = 0;
    control_after_fork();
    fork_child_flag = true;
}

__attribute__((constructor)) static void shim_init(void)
{
    pthread_atfork(NULL, NULL, atfork_child);
    shim_set_starter(start);
}

/* The listener thread still runs while the process exits: the paths are read
 * under g.lock, and `exiting` keeps it from healing the socket file this
 * removes (which would leave a new one behind). */
__attribute__((destructor)) static void shim_fini(void)
{
    char sock[sizeof g.sock_path], claim[sizeof g.claim_path];

    if (__atomic_load_n(&g.started_pid, __ATOMIC_ACQUIRE) != getpid())
        return;
    content_exit();
    pthread_mutex_lock(&g.lock);
    __atomic_store_n(&exiting, true, __ATOMIC_RELEASE);
    memcpy(sock, g.sock_path, sizeof sock);
    memcpy(claim, g.claim_path, sizeof claim);
    pthread_mutex_unlock(&g.lock);
    if (sock[0])
        unlink(sock);
    if (claim[0])
        unlink(claim);
}
