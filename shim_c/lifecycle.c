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
             "server; this process cannot be checkpointed with cuinterpose",
             path, why, (int)st->st_uid, (unsigned)(st->st_mode & 07777));
    return false;
}

static bool control_dir_init(void)
{
    const char *d = shim_settings()->control_dir;
    struct stat st;

    /* Room for "/cuinterpose-<pid>.sock" and the temporary name. */
    if (d[0] != '/' || strlen(d) + 48 >= sizeof g.control_dir) {
        shim_log(LOG_ERROR, "%s=%s must be an absolute path of at most %zu bytes",
                 CUIP_CONTROL_DIR_ENV, d, sizeof g.control_dir - 48);
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

/* Under g.init_lock (state.c), once per process. */
static void start(void)
{
    control_dir_init();
    pthread_mutex_lock(&g.lock);
    participant_init(fork_child_flag);
    pthread_mutex_unlock(&g.lock);
    if (g.control_dir[0]) {
        int fd = listener_create();
        if (fd >= 0) {
            g.listen_fd = fd;
            if (start_thread(control_listen, (void *)(intptr_t)fd) != 0) {
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
}

/* ------------------------------------------------------------ fork and exit */
static void atfork_child(void)
{
    shim_state_after_fork();
    inherited_state = obj_count() > 0;
    obj_drop_all();
    owned_after_fork();
    unowned_after_fork();
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

__attribute__((destructor)) static void shim_fini(void)
{
    if (g.started_pid != getpid())
        return;
    if (g.sock_path[0])
        unlink(g.sock_path);
    if (g.claim_path[0])
        unlink(g.claim_path);
}
