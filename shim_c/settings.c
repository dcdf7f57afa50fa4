/*
 * Settings: every environment variable the shim reads, read once, on the
 * first call of shim_settings(). Every entry point resolves the driver before
 * anything else, and resolving reads the settings first, so the log level
 * holds from the first line logged.
 *
 * Every value is checked: a bad one is named in a warning, with the value,
 * and the default is used. The application must keep running, so a typo
 * never stops it; the warning is the place to see it.
 *
 * Three kinds. User settings: the control dir, the participant id, the
 * deadlines and leases, the content mode, what is staged and owned, the
 * timing line, debug, and the gate (its 0 is for diagnosis, warned at
 * start). Tuning knobs: the staging pool's (COPY_*, STAGING_*), each
 * measured in docs/benchmarks.md. Test hooks (TRUST_UID, which changes whom
 * the shim trusts, and TEST_RELEASE_DELAY_MS): compiled in only with
 * CUINTERPOSE_TEST_HOOKS, a test build's; a release build names one that is
 * set and ignores it.
 *
 * Copy defaults (content.c says how they were measured):
 *  - SNAPSHOT_SHIM_COPY_THREADS: min(16, online CPUs). Populate and register
 *    are CPU work in the kernel that scales with threads; more threads than
 *    CPUs only contend.
 *  - SNAPSHOT_SHIM_COPY_CHUNK_MIB: 64 (at most; staging.c makes it smaller
 *    for a phase that would not give every thread a few chunks).
 *  - SNAPSHOT_SHIM_STAGING_THP: 1 (staging memory advised MADV_HUGEPAGE).
 *  - SNAPSHOT_SHIM_STAGING_BOUNCE_MIB: 8 (per staging thread, pinned once and
 *    kept; 0: register the staging memory chunk by chunk instead).
 *  - SNAPSHOT_SHIM_STAGING_RESIDENT_MIB: 0 (off; else the staging memory of a
 *    SAVE of at most this many MiB is kept, populated, from one cycle to the
 *    next: content.c).
 *  - SNAPSHOT_SHIM_KEEP_HOST_COPY: 0 (1: a pinned host copy of every
 *    allocation SAVE moves, made in the background and kept across cycles;
 *    SAVE copies only what changed: keep.c).
 *  - SNAPSHOT_SHIM_TIMING: 0 (1: where a SAVE/LOAD's time went, on stderr).
 *  - SNAPSHOT_SHIM_STAGE_PRIVATE: 1 (SAVE moves every allocation this
 *    process created, shared or private; 0: private ones stay with the
 *    native checkpoint, as before issue 19).
 *  - SNAPSHOT_SHIM_STAGING_DEPTH: 2 (pieces each bounce buffer is cut in,
 *    2..8: depth - 1 copies stay queued while the thread memcpy's one;
 *    why 2: staging.c).
 *  - SNAPSHOT_SHIM_STAGING_POPULATE_THREADS: 0 (SAVE: that many more threads
 *    fault the staging memory of the chunks queued next in, ahead of the
 *    copy threads, instead of the memcpy alone faulting it: staging.c).
 *  - SNAPSHOT_SHIM_STAGING_CHUNKS_PER_THREAD: unset, 8 for SAVE and 4 for
 *    LOAD (a phase's chunks are made small enough that every copy thread
 *    gets about this many; set, both directions take it).
 *  - SNAPSHOT_SHIM_STAGING_BOUNCE_PIN: alloc (cuMemHostAlloc, known to go
 *    through the native checkpoint and CRIU on the H200); register: a mapping
 *    of the shim's, populated, then cuMemHostRegister'd (staging.c says why).
 *  - SNAPSHOT_SHIM_STAGING_BOUNCE_KEEP: 1 (the bounce buffers stay pinned
 *    between cycles: threads x BOUNCE_MIB, 128 MiB at 16 threads; 0: LOAD
 *    frees them, and every SAVE pins them again).
 *  - SNAPSHOT_SHIM_STAGING_RELEASE_AFTER_REPLY: 1 (LOAD frees the staged
 *    copies on a thread of its own after its reply; 0: inside the op).
 *  - SNAPSHOT_SHIM_OWN_ALLOCATIONS: 1 (cuMemAlloc memory of at least the
 *    granularity is backed by VMM allocations the shim owns and shares:
 *    owned.c, ipc.c).
 *  - SNAPSHOT_SHIM_OWN_SMALL: 0 (1: smaller requests too, each in a
 *    granularity of its own: 2 MiB of device memory per cudaMalloc).
 */
#include "shim.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define DEBUG_ENV "SNAPSHOT_SHIM_DEBUG"
#define IO_TIMEOUT_ENV "SNAPSHOT_SHIM_IO_TIMEOUT_S"
#define PEER_TIMEOUT_ENV "SNAPSHOT_PEER_TIMEOUT_S"
#define CONTENT_MODE_ENV "SNAPSHOT_CONTENT_MODE"
#define COPY_THREADS_ENV "SNAPSHOT_SHIM_COPY_THREADS"
#define COPY_CHUNK_ENV "SNAPSHOT_SHIM_COPY_CHUNK_MIB"
#define LEASE_IDLE_ENV "SNAPSHOT_LEASE_IDLE_S"
#define LEASE_HANDSHAKE_ENV "SNAPSHOT_LEASE_HANDSHAKE_S"
#define TRUST_UID_ENV "SNAPSHOT_SHIM_TRUST_UID"
#define RELEASE_DELAY_ENV "SNAPSHOT_SHIM_TEST_RELEASE_DELAY_MS"
#define HOST_AVAILABLE_ENV "SNAPSHOT_SHIM_TEST_HOST_AVAILABLE_MIB"
#define STAGING_THP_ENV "SNAPSHOT_SHIM_STAGING_THP"
#define STAGING_BOUNCE_ENV "SNAPSHOT_SHIM_STAGING_BOUNCE_MIB"
#define STAGING_RESIDENT_ENV "SNAPSHOT_SHIM_STAGING_RESIDENT_MIB"
#define KEEP_HOST_COPY_ENV "SNAPSHOT_SHIM_KEEP_HOST_COPY"
#define TIMING_ENV "SNAPSHOT_SHIM_TIMING"
#define STAGE_PRIVATE_ENV "SNAPSHOT_SHIM_STAGE_PRIVATE"
#define STAGING_PREFAULT_ENV "SNAPSHOT_SHIM_STAGING_PREFAULT"
#define STAGING_DEPTH_ENV "SNAPSHOT_SHIM_STAGING_DEPTH"
#define STAGING_AHEAD_ENV "SNAPSHOT_SHIM_STAGING_POPULATE_THREADS"
#define STAGING_SPREAD_ENV "SNAPSHOT_SHIM_STAGING_CHUNKS_PER_THREAD"
#define STAGING_BOUNCE_KEEP_ENV "SNAPSHOT_SHIM_STAGING_BOUNCE_KEEP"
#define STAGING_RELEASE_ENV "SNAPSHOT_SHIM_STAGING_RELEASE_AFTER_REPLY"
#define STAGING_BOUNCE_PIN_ENV "SNAPSHOT_SHIM_STAGING_BOUNCE_PIN"
#define QUIESCE_TIMEOUT_ENV "SNAPSHOT_SHIM_QUIESCE_TIMEOUT_S"
#define GATE_ENV "SNAPSHOT_SHIM_GATE"
#define OWN_ENV "SNAPSHOT_SHIM_OWN_ALLOCATIONS"
#define OWN_SMALL_ENV "SNAPSHOT_SHIM_OWN_SMALL"
/* CUIP_CONTROL_DIR_ENV and CUIP_PARTICIPANT_ENV are in protocol.h: the
 * coordinator sets them too. */

#define IO_TIMEOUT_MS_DEFAULT 5000
/* The coordinator's SNAPSHOT_PHASE_TIMEOUT_S (120 s) must exceed this, or its
 * wait expires with ours. */
#define PEER_TIMEOUT_MS_DEFAULT 10000
/* Longer than the coordinator's phase timeout (120 s) and its local steps:
 * a holder in the middle of a run is never idle that long. */
#define LEASE_IDLE_MS_DEFAULT 600000
/* A run sends its first phase op right after HANDSHAKE and INSPECT and its
 * own checks of what they answered (a restore: the state file's topology
 * against INSPECT's), far inside this. */
#define LEASE_HANDSHAKE_MS_DEFAULT 10000
/* QUIESCE: time for the application to reach a quiet point (specs/quiesce.md). */
#define QUIESCE_TIMEOUT_MS_DEFAULT 10000
#define UID_MAX_TRUSTED 4294967294ul
#define THREADS_DEFAULT 16ul
#define THREADS_MAX 64ul
#define CHUNK_MIB_DEFAULT 64ul
#define CHUNK_MIB_MAX 4096ul
#define BOUNCE_MIB_DEFAULT 8ul
#define BOUNCE_MIB_MAX 1024ul
#define RESIDENT_MIB_MAX (1ul << 22) /* 4 TiB */
#define DEPTH_DEFAULT 2ul

static struct shim_settings settings;
static pthread_once_t settings_once = PTHREAD_ONCE_INIT;

static bool env_flag(const char *name)
{
    const char *v = getenv(name);
    if (!v)
        return false;
    return !strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes") ||
           !strcasecmp(v, "on");
}

/* Seconds (a decimal, e.g. "2.5") in (0, 3600], in milliseconds. */
static long env_seconds_ms(const char *name, long def_ms)
{
    const char *v = getenv(name);
    char *end;
    double x;

    if (!v || !*v)
        return def_ms;
    errno = 0;
    x = strtod(v, &end);
    if (errno || *end || !(x > 0.0) || x > 3600.0) {
        shim_log(LOG_WARN, "%s=%s is not a number of seconds in (0, 3600]; using %ld ms", name,
                 v, def_ms);
        return def_ms;
    }
    return x * 1000.0 < 1.0 ? 1 : (long)(x * 1000.0);
}

/* A decimal count in [lo, hi]; `what` names it in the warning. */
static unsigned long env_count(const char *name, unsigned long lo, unsigned long hi,
                               unsigned long def, const char *what)
{
    const char *v = getenv(name);
    char *end;
    unsigned long x;

    if (!v || !*v)
        return def;
    errno = 0;
    x = strtoul(v, &end, 10);
    if (errno || *end || v[0] == '-' || v[0] == '+' || x < lo || x > hi) {
        shim_log(LOG_WARN, "%s=%s is not %s in [%lu, %lu]; using %lu", name, v, what, lo, hi,
                 def);
        return def;
    }
    return x;
}

/* "0" or "1"; `def` when unset. */
static bool env_bool(const char *name, bool def)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return def;
    if (!strcmp(v, "0") || !strcmp(v, "1"))
        return v[0] == '1';
    shim_log(LOG_WARN, "%s=%s is neither 0 nor 1; using %d", name, v, (int)def);
    return def;
}

static bool env_content_native(void)
{
    const char *v = getenv(CONTENT_MODE_ENV);
    if (!v || !*v || !strcmp(v, "host"))
        return false;
    if (!strcmp(v, "native"))
        return true;
    shim_log(LOG_WARN, "%s=%s is neither host nor native; using host", CONTENT_MODE_ENV, v);
    return false;
}

/* True for register, false for alloc (the default). */
static bool env_bounce_pin(void)
{
    const char *v = getenv(STAGING_BOUNCE_PIN_ENV);
    if (!v || !*v || !strcmp(v, "alloc"))
        return false;
    if (!strcmp(v, "register"))
        return true;
    shim_log(LOG_WARN, "%s=%s is neither alloc nor register; using alloc",
             STAGING_BOUNCE_PIN_ENV, v);
    return false;
}

#ifdef CUINTERPOSE_TEST_HOOKS
static void test_hooks_load(struct shim_settings *s)
{
    /* Unset, or a bad value (named in the warning): the usual trust. */
    s->trust_uid = (long)env_count(TRUST_UID_ENV, 0, UID_MAX_TRUSTED, UID_MAX_TRUSTED + 1,
                                   "a uid");
    if (s->trust_uid > (long)UID_MAX_TRUSTED)
        s->trust_uid = -1;
    s->test_release_delay_ms = (unsigned)env_count(RELEASE_DELAY_ENV, 0, 10000, 0,
                                                   "a delay in ms");
    s->test_host_available = (size_t)env_count(HOST_AVAILABLE_ENV, 0, RESIDENT_MIB_MAX, 0,
                                               "a size in MiB")
                             << 20;
    s->staging_prefault = env_bool(STAGING_PREFAULT_ENV, false);
}
#else
/* A release build has no test hook: one asked for is named, so that nobody
 * believes it took (above all SNAPSHOT_SHIM_TRUST_UID, whom the shim trusts). */
static void test_hooks_load(struct shim_settings *s)
{
    static const char *const hooks[] = {TRUST_UID_ENV, RELEASE_DELAY_ENV, HOST_AVAILABLE_ENV,
                                        STAGING_PREFAULT_ENV};

    (void)s;
    for (size_t i = 0; i < sizeof hooks / sizeof hooks[0]; i++)
        if (getenv(hooks[i]))
            shim_log(LOG_WARN, "%s is a test hook, not in this build (a release one): "
                     "ignored", hooks[i]);
}
#endif

static void settings_load(void)
{
    struct shim_settings *s = &settings;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned long threads = THREADS_DEFAULT;
    const char *dir = getenv(CUIP_CONTROL_DIR_ENV);
    const char *pin = getenv(CUIP_PARTICIPANT_ENV);

    /* First, so that the warnings below follow the level asked for. */
    s->log_level = env_flag(DEBUG_ENV) ? LOG_DEBUG : LOG_WARN;
    shim_log_set_level(s->log_level);
    s->io_timeout_ms = env_seconds_ms(IO_TIMEOUT_ENV, IO_TIMEOUT_MS_DEFAULT);
    s->peer_timeout_ms = env_seconds_ms(PEER_TIMEOUT_ENV, PEER_TIMEOUT_MS_DEFAULT);
    s->native_content = env_content_native();
    if (cpus >= 1 && (unsigned long)cpus < threads)
        threads = (unsigned long)cpus;
    s->copy_threads = (unsigned)env_count(COPY_THREADS_ENV, 1, THREADS_MAX, threads,
                                          "a thread count");
    s->copy_chunk = (size_t)env_count(COPY_CHUNK_ENV, 1, CHUNK_MIB_MAX, CHUNK_MIB_DEFAULT,
                                      "a chunk size in MiB")
                    << 20;
    s->staging_thp = env_bool(STAGING_THP_ENV, true);
    s->staging_bounce = (size_t)env_count(STAGING_BOUNCE_ENV, 0, BOUNCE_MIB_MAX,
                                          BOUNCE_MIB_DEFAULT, "a buffer size in MiB")
                        << 20;
    s->staging_resident = (size_t)env_count(STAGING_RESIDENT_ENV, 0, RESIDENT_MIB_MAX, 0,
                                            "a size in MiB")
                          << 20;
    s->keep_host_copy = env_bool(KEEP_HOST_COPY_ENV, false);
    s->timing = env_bool(TIMING_ENV, false);
    s->stage_private = env_bool(STAGE_PRIVATE_ENV, true);
    s->staging_depth = (unsigned)env_count(STAGING_DEPTH_ENV, 2, STAGING_DEPTH_MAX,
                                           DEPTH_DEFAULT, "a number of bounce pieces");
    s->staging_ahead = (unsigned)env_count(STAGING_AHEAD_ENV, 0, THREADS_MAX, 0,
                                           "a thread count");
    s->staging_spread = (unsigned)env_count(STAGING_SPREAD_ENV, 1, 64, 0, "a number of chunks");
    s->staging_bounce_keep = env_bool(STAGING_BOUNCE_KEEP_ENV, true);
    s->staging_release_after_reply = env_bool(STAGING_RELEASE_ENV, true);
    s->staging_bounce_register = env_bounce_pin();
    snprintf(s->control_dir, sizeof s->control_dir, "%s",
             dir && *dir ? dir : CUIP_CONTROL_DIR_DEFAULT);
    snprintf(s->participant, sizeof s->participant, "%s", pin ? pin : "");
    s->lease_idle_ms = env_seconds_ms(LEASE_IDLE_ENV, LEASE_IDLE_MS_DEFAULT);
    s->lease_handshake_ms = env_seconds_ms(LEASE_HANDSHAKE_ENV, LEASE_HANDSHAKE_MS_DEFAULT);
    s->quiesce_timeout_ms = env_seconds_ms(QUIESCE_TIMEOUT_ENV, QUIESCE_TIMEOUT_MS_DEFAULT);
    s->gate = env_bool(GATE_ENV, true);
    if (!s->gate)
        shim_log(LOG_WARN, "%s=0: the gate never closes; QUIESCE only drains the device once, "
                 "and a capture under running work can lose updates or fault", GATE_ENV);
    s->own_allocations = env_bool(OWN_ENV, true);
    s->own_small = env_bool(OWN_SMALL_ENV, false);
    test_hooks_load(s);
}

bool shim_trusted_uid(uid_t uid)
{
#ifdef CUINTERPOSE_TEST_HOOKS
    long only = shim_settings()->trust_uid;
    if (only >= 0)
        return (long)uid == only;
#endif
    return uid == 0 || uid == getuid();
}

const struct shim_settings *shim_settings(void)
{
    pthread_once(&settings_once, settings_load);
    return &settings;
}
