/* Small helpers with no state of the shim's: logging, time, randomness, hex,
 * byte comparisons. */
#include "shim.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

static int log_level = LOG_WARN; /* set once by settings.c, read by every thread */

void shim_log_set_level(int level)
{
    __atomic_store_n(&log_level, level, __ATOMIC_RELAXED);
}

/* One write, so that lines from several threads do not interleave, and no
 * SIGPIPE: stderr may be a pipe whose reader is gone, and a log line must
 * never kill the application. SIGPIPE is blocked around the write and a
 * SIGPIPE it raised is consumed (one that was already pending stays). */
static void write_stderr(const char *buf, size_t n)
{
    sigset_t pipe_set, old, pending;
    bool was_pending;
    ssize_t w;

    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    if (pthread_sigmask(SIG_BLOCK, &pipe_set, &old) != 0)
        return;
    was_pending = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE);
    w = write(2, buf, n);
    if (w < 0 && errno == EPIPE && !was_pending) {
        struct timespec zero = {0, 0};
        while (sigtimedwait(&pipe_set, NULL, &zero) < 0 && errno == EINTR)
            ;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

void shim_write_line(const char *buf, size_t n)
{
    write_stderr(buf, n);
}

void shim_log(int level, const char *fmt, ...)
{
    static const char *names[] = {"error", "warning", "info", "debug"};
    char buf[1400];
    int n, m;
    va_list ap;

    if (level > __atomic_load_n(&log_level, __ATOMIC_RELAXED))
        return;
    n = snprintf(buf, sizeof buf, "cuinterpose[%d]: %s: ", (int)getpid(), names[level]);
    if (n < 0)
        return;
    va_start(ap, fmt);
    m = vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        return;
    n += m;
    if ((size_t)n > sizeof buf - 2)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    write_stderr(buf, (size_t)n);
}

uint64_t shim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int shim_random(void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = getrandom(p, len, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

void shim_random_id(uint8_t id[CUIP_ID_LEN])
{
    do {
        if (shim_random(id, CUIP_ID_LEN) != 0) {
            /* getrandom cannot fail on Linux >= 3.17 with a small buffer;
             * abort rather than hand out predictable ids. */
            shim_log(LOG_ERROR, "getrandom failed: %s", strerror(errno));
            abort();
        }
    } while (shim_is_zero(id, CUIP_ID_LEN));
}

void shim_hex(char *out, const uint8_t *in, size_t len)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < len; i++) {
        out[2 * i] = digits[in[i] >> 4];
        out[2 * i + 1] = digits[in[i] & 15];
    }
}

bool shim_is_participant(const char *p)
{
    for (int i = 0; i < CUIP_PARTICIPANT_LEN; i++) {
        char c = p[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            return false;
    }
    return true;
}

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

bool shim_unhex(uint8_t *out, const char *in, size_t hexlen)
{
    if (hexlen % 2)
        return false;
    for (size_t i = 0; i < hexlen; i += 2) {
        int hi = hex_digit(in[i]), lo = hex_digit(in[i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        if (out)
            out[i / 2] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

bool shim_is_zero(const void *p, size_t len)
{
    const uint8_t *b = p;
    uint8_t acc = 0;
    for (size_t i = 0; i < len; i++)
        acc |= b[i];
    return acc == 0;
}

bool shim_ct_equal(const void *a, const void *b, size_t len)
{
    const uint8_t *x = a, *y = b;
    uint8_t acc = 0;
    for (size_t i = 0; i < len; i++)
        acc |= (uint8_t)(x[i] ^ y[i]);
    return acc == 0;
}
