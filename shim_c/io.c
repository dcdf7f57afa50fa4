/*
 * Bounded socket I/O and replies: one request per connection, every read and
 * write before a deadline, sends with MSG_NOSIGNAL. A peer that hangs up or
 * stalls costs a timeout, never the process.
 */
#include "shim.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

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

/* The descriptors of one recvmsg: up to `max` into fds[*n], any other closed
 * and counted as too many (as are those the kernel dropped: MSG_CTRUNC). */
static void take_fds(struct msghdr *m, int *fds, unsigned max, unsigned *n, bool *too_many)
{
    if (m->msg_flags & MSG_CTRUNC)
        *too_many = true;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t nfd = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < nfd; i++) {
            int x;
            memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof x);
            if (*n < max) {
                fds[(*n)++] = x;
            } else {
                close(x);
                *too_many = true;
            }
        }
    }
}

/* Read exactly `len` bytes. With fds, SCM_RIGHTS are accepted: up to `max`
 * descriptors land in fds[*n...] in the order sent; more set *too_many (the
 * rest closed). Room for one more than the protocol's most, so that a request
 * of too many is told from one of exactly CUIP_STORED_MAX_PARTS. */
int io_read_fds(int fd, void *buf, size_t len, uint64_t deadline, int *fds, unsigned max,
                unsigned *n, bool *too_many)
{
    char *p = buf;
    errno = 0;
    while (len > 0) {
        union {
            struct cmsghdr h;
            char b[CMSG_SPACE(sizeof(int) * (CUIP_STORED_MAX_PARTS + 1))];
        } cbuf;
        struct iovec iov = {.iov_base = p, .iov_len = len};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
        ssize_t got;

        if (fds) {
            m.msg_control = cbuf.b;
            m.msg_controllen = sizeof cbuf.b;
        }
        if (wait_fd(fd, POLLIN, deadline) != 0)
            return -1;
        got = recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (got < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return -1;
        }
        if (fds)
            take_fds(&m, fds, max, n, too_many);
        if (got == 0) {
            errno = 0; /* peer closed */
            return -1;
        }
        p += got;
        len -= (size_t)got;
    }
    return 0;
}

/* Read exactly `len` bytes. With fd_out, SCM_RIGHTS are accepted: the first
 * descriptor lands in *fd_out (if still -1), any other is closed. */
int io_read_all(int fd, void *buf, size_t len, uint64_t deadline, int *fd_out)
{
    int got = -1;
    unsigned n = 0;
    bool too_many = false;
    int rc = io_read_fds(fd, buf, len, deadline, fd_out ? &got : NULL, 1, &n, &too_many);

    if (n && *fd_out < 0)
        *fd_out = got;
    else if (n)
        close(got);
    return rc;
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

void reply_init(struct reply *r, uint16_t op)
{
    memset(r, 0, sizeof *r);
    r->fd = -1;
    r->h.magic = CUIP_MAGIC;
    r->h.version = CUIP_VERSION;
    r->h.op = op;
    memcpy(r->h.participant, g.participant, CUIP_PARTICIPANT_LEN);
    r->h.pid = (uint32_t)getpid();
}

int reply_send(int s, struct reply *r, uint64_t deadline)
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
