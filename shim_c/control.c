/*
 * The control server (specs/protocol.md): the coordinator's requests.
 *
 * One listener thread accepts; each connection gets its own short-lived
 * thread, so a peer's EXPORT is served while a phase op runs (two
 * participants that import from each other during RESTORE_UNICAST would
 * deadlock otherwise). One request per connection, read and answered with
 * io.c's deadlines. Every request is validated strictly; phase ops go
 * through one phase machine (CUIP_OPS, CUIP_PHASE_OPS and CUIP_ROLLBACK_OPS in
 * protocol.h): a failed one leaves the shim FAILED with its reason, a
 * refused or retryable one (RETRY) in the phase it was in.
 *
 * One coordinator at a time: the lease (specs/recovery.md). HANDSHAKE with
 * a token takes it; every later request of the run carries the same token;
 * RELEASE ends it. A request with another token is refused, naming the
 * holder, until the holder is gone: its process exited (a pidfd, or kill
 * where pidfd_open is missing) or, when its pid is not visible in our pid
 * namespace, it sent nothing for SNAPSHOT_LEASE_IDLE_S. A holder that has
 * not acted (nothing past HANDSHAKE and INSPECT) holds it against another
 * coordinator's HANDSHAKE only for SNAPSHOT_LEASE_HANDSHAKE_S: any process
 * of the trusted uids can send a HANDSHAKE, and one that goes on to nothing
 * must not keep the group from its restore or recover.
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
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNECTIONS 64

static int connections; /* atomic */

/* ------------------------------------------------------------ requests */
static const char *op_name(unsigned op)
{
    return cuip_op_name(op); /* from the op table, CUIP_OPS */
}

/* The stat fields a request of its op may carry (protocol.h's per-op names):
 * QUIESCE its deadline and round flag, STATUS what it asks; others none. */
static bool request_stats_ok(const struct cuip_header *q)
{
    switch (q->op) {
    case CUIP_OP_QUIESCE:
        return cuip_quiesce_round(q) <= 1 && !q->stat_bytes && !q->stat_copy_ns;
    case CUIP_OP_STATUS:
        return cuip_status_ask(q) <= CUIP_ASK_ALL && !q->stat_bytes && !q->stat_elapsed_ns &&
               !q->stat_copy_ns;
    case CUIP_OP_EXPORT:
        return cuip_export_withdraw(q) <= CUIP_EXPORT_WITHDRAW && !q->stat_elapsed_ns &&
               !q->stat_copy_ns;
    case CUIP_OP_STORE_STAGED:
    case CUIP_OP_FETCH_STAGED:
        return cuip_status_ask(q) <= CUIP_ASK_DRIVER && !q->stat_bytes && !q->stat_elapsed_ns &&
               !q->stat_copy_ns;
    case CUIP_OP_HOST_COPY:
        return (cuip_host_copy_request(q) == CUIP_HOST_COPY_KEEP ||
                cuip_host_copy_request(q) == CUIP_HOST_COPY_GIVE_BACK) &&
               !q->stat_bytes && !q->stat_elapsed_ns && !q->stat_copy_ns;
    default:
        return !q->stat_count && !q->stat_bytes && !q->stat_elapsed_ns && !q->stat_copy_ns;
    }
}

/* Strict validation: anything non-zero where zero is required, a wrong
 * magic or version, an unknown op or a foreign participant is refused. */
static bool text_length_ok(const struct cuip_header *q)
{
    if (q->op == CUIP_OP_EXPORT)
        return q->message_length == CUIP_PARTICIPANT_LEN;
    if (q->op == CUIP_OP_LOAD_ALLOCATIONS)
        return q->message_length <= CUIP_MESSAGE_MAX;
    return q->message_length == 0;
}

static bool validate(const struct cuip_header *q, struct reply *r)
{
    bool exporting = q->op == CUIP_OP_EXPORT;
    if (q->magic != CUIP_MAGIC) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "bad magic %#x", q->magic);
        return false;
    }
    if (q->version != CUIP_VERSION) {
        /* The reply's header carries this shim's version: the coordinator
         * names both and which side to upgrade. */
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "this shim speaks protocol version %u, the "
                  "request version %u: nothing was done", CUIP_VERSION, q->version);
        return false;
    }
    if (q->op < CUIP_OP_HANDSHAKE || q->op > CUIP_OP_MAX) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "unknown op %u", q->op);
        return false;
    }
    if (q->status || q->count || q->pid || q->phase || q->flags || !request_stats_ok(q) ||
        !text_length_ok(q)) {
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
    } else if (q->resource_kind || (!shim_is_zero(q->resource_id, CUIP_ID_LEN) &&
                                    q->op != CUIP_OP_STORE_STAGED &&
                                    q->op != CUIP_OP_FETCH_STAGED)) {
        /* STORE_STAGED and FETCH_STAGED name the dump in resource_id (stored.c). */
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "%s request carries EXPORT-only fields",
                  op_name(q->op));
        return false;
    }
    /* STATUS may come from anyone allowed to connect (a status command, not the
     * coordinator): it need not know the id, and binds nothing. */
    if (q->op == CUIP_OP_STATUS && shim_is_zero(q->participant, CUIP_PARTICIPANT_LEN))
        return true;
    if (q->op == CUIP_OP_HANDSHAKE || q->op == CUIP_OP_RELEASE) {
        /* Sent before the participant is known (RELEASE: by a run that may
         * have failed at HANDSHAKE); the lease token says whose it is. */
        if (!shim_is_zero(q->participant, CUIP_PARTICIPANT_LEN)) {
            reply_msg(r, CUIP_STATUS_BAD_REQUEST, "%s must not name a participant",
                      op_name(q->op));
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

/* What each phase op reaches: the tables in protocol.h (the phases it is
 * served in: CUIP_OPS). `next` is 0 for an op that is no phase op. */
struct phase_op {
    uint16_t next;
    bool stats; /* the reply carries the transfer statistics */
};

static const struct phase_op phase_ops[CUIP_OP_MAX + 1] = {
#define PHASE_OP(op, next, stats) [CUIP_OP_##op] = {CUIP_PHASE_##next, stats},
    CUIP_PHASE_OPS(PHASE_OP)
    CUIP_ROLLBACK_OPS(PHASE_OP)
#undef PHASE_OP
};

/* The work of each phase op. A switch over the enum: an op added to the
 * protocol without its work here does not compile (-Wswitch). */
static phase_work_fn *phase_work(enum cuip_op op)
{
    switch (op) {
    case CUIP_OP_QUIESCE:
        return quiesce_run;
    case CUIP_OP_PREPARE_MULTICAST:
        return multicast_prepare;
    case CUIP_OP_SAVE_ALLOCATIONS:
        return content_save;
    case CUIP_OP_PREPARE_UNICAST:
        return unicast_prepare;
    case CUIP_OP_LOAD_ALLOCATIONS:
        return content_load;
    case CUIP_OP_RESTORE_UNICAST:
        return unicast_restore;
    case CUIP_OP_RESTORE_MULTICAST_CREATORS:
        return multicast_restore_creators;
    case CUIP_OP_RESTORE_MULTICAST_IMPORTERS:
        return multicast_restore_importers;
    case CUIP_OP_RESTORE_MULTICAST_DEVICES:
        return multicast_restore_devices;
    case CUIP_OP_RESTORE_MULTICAST_BINDINGS:
        return multicast_restore_bindings;
    case CUIP_OP_ROLLBACK_ALLOCATIONS:
        return rollback_allocations;
    case CUIP_OP_ROLLBACK_IMPORTS:
        return rollback_imports;
    case CUIP_OP_HANDSHAKE:
    case CUIP_OP_INSPECT:
    case CUIP_OP_EXPORT:
    case CUIP_OP_RELEASE:
    case CUIP_OP_STATUS:
    case CUIP_OP_STORE_STAGED:
    case CUIP_OP_FETCH_STAGED:
    case CUIP_OP_HOST_COPY:
        break; /* not phase ops */
    }
    return NULL;
}

/* Before the first teardown, the device work of every context the shim
 * knows (quiesce.c's set: the objects' and the active primary contexts) is
 * drained, so that no kernel or copy still in flight touches memory
 * PREPARE_UNICAST unmaps. Each cuCtxSynchronize runs without g.lock (it
 * blocks). The group must not submit new work meanwhile (specs/shim.md).
 * Nothing is torn down yet, so a failure refuses the op. */
static enum phase_result drain_contexts(struct reply *r)
{
    struct ctx_set set;
    const char *call = NULL;
    uint32_t failed = 0;
    char msg[160];
    CUresult rc;

    if (!real.cuCtxSynchronize) {
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "PREPARE_MULTICAST: the driver has no "
                  "cuCtxSynchronize; device work cannot be drained");
        return PHASE_REFUSED;
    }
    if (ctx_set_collect(&set, msg, sizeof msg) != 0) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "PREPARE_MULTICAST: %s", msg);
        return PHASE_REFUSED;
    }
    rc = ctx_set_sync(&set, &failed, &call);
    if (rc != CUDA_SUCCESS) {
        shim_fail(msg, sizeof msg, call, rc);
        reply_msg(r, CUIP_STATUS_CUDA_FAILED, "PREPARE_MULTICAST: draining device work "
                  "of context %u of %u: %s", failed + 1, set.n, msg);
        ctx_set_free(&set);
        return PHASE_REFUSED;
    }
    shim_log(LOG_DEBUG, "drained the device work of %u contexts", set.n);
    ctx_set_free(&set);
    return PHASE_DONE;
}

/* Under g.lock: claim the shim for phase op `op` from phase *from, or say
 * why not in `r` (false). The phase leaves ACTIVE before any work, so the
 * application's tracked calls see NOT_READY from then on. */
static bool phase_op_begin(uint16_t op, const struct phase_op *d, uint64_t t0, uint16_t *from,
                           struct reply *r)
{
    if (g.busy) {
        reply_msg(r, CUIP_STATUS_REFUSED, "another phase op is running");
        return false;
    }
    *from = g.phase;
    if (!cuip_op_served_in(op, *from)) {
        reply_msg(r, CUIP_STATUS_WRONG_PHASE, "%s is not served in phase %u", op_name(op),
                  *from);
        return false;
    }
    g.busy = true;
    g.hold_for_verify = false; /* a rollback after a restore: held again at its end */
    g.op_in_flight = op;
    g.op_started_ns = t0;
    __atomic_store_n(&g.phase_bytes_done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&g.phase_bytes_total, 0, __ATOMIC_RELAXED);
    /* QUIESCE is ACTIVE while it works, an advance out of QUIESCED too: the
     * application's calls flow through the gate, never answered NOT_READY. */
    if (op == CUIP_OP_QUIESCE)
        g.phase = CUIP_PHASE_ACTIVE;
    else if (*from == CUIP_PHASE_ACTIVE)
        g.phase = d->next;
    return true;
}

/* Under g.lock: the phase the op's result `rc` leaves the shim in, and the
 * reply's status. */
static void phase_op_settle(uint16_t op, const struct phase_op *d, uint64_t t0, uint16_t from,
                            enum phase_result rc, struct reply *r)
{
    if (rc == PHASE_DONE) {
        g.phase = d->next;
        r->h.status = CUIP_STATUS_OK;
        if (d->stats)
            r->h.stat_elapsed_ns = shim_now_ns() - t0;
        shim_log(LOG_INFO, "%s done: phase %u", op_name(op), g.phase);
    } else if (rc == PHASE_PENDING) {
        /* Not quiet yet: ACTIVE, and the gate stays closed for the next
         * round (quiesce.c wrote the reply). */
        g.phase = CUIP_PHASE_ACTIVE;
    } else if (rc == PHASE_REFUSED || rc == PHASE_RETRY) {
        /* A refused QUIESCE opened the gate: ACTIVE, even after an advance. */
        g.phase = op == CUIP_OP_QUIESCE ? CUIP_PHASE_ACTIVE : from;
        if (!r->h.status)
            reply_msg(r, rc == PHASE_RETRY ? CUIP_STATUS_RETRY : CUIP_STATUS_REFUSED,
                      "%s not done", op_name(op));
        if (rc == PHASE_RETRY) {
            if (d->stats)
                r->h.stat_elapsed_ns = shim_now_ns() - t0;
            shim_log(LOG_WARN, "%s to be retried: %.*s", op_name(op),
                     (int)r->h.message_length, r->msg);
        }
    } else {
        /* Fail-stop until a rollback (ROLLBACK_ALLOCATIONS is served in
         * FAILED while the staged bytes are all there). */
        g.phase = CUIP_PHASE_FAILED;
        snprintf(g.reason, sizeof g.reason, "%s", r->h.message_length ? r->msg : op_name(op));
        if (!r->h.status)
            reply_msg(r, CUIP_STATUS_INTERNAL, "%s failed", op_name(op));
        shim_log(LOG_ERROR, "%s failed: %s", op_name(op), g.reason);
    }
    if (g.phase != CUIP_PHASE_FAILED)
        g.reason[0] = 0; /* a rollback out of FAILED forgets the old reason */
    g.busy = false;
    g.op_in_flight = 0;
}

/* Under g.lock, after phase_op_settle: whether the gate opens now. Back in
 * ACTIVE (restored, rolled back, or a QUIESCE refused) it opens last, once
 * the topology is back; a pending QUIESCE keeps it closed. Restored or
 * rolled back under a lease (not a QUIESCE, which never left ACTIVE's
 * topology), it opens at the RELEASE that follows the coordinator's
 * verification, or when its holder is gone. */
static bool phase_op_reopens(uint16_t op, uint16_t from, enum phase_result rc)
{
    if (g.phase != CUIP_PHASE_ACTIVE || rc == PHASE_PENDING)
        return false;
    if (op != CUIP_OP_QUIESCE && from != CUIP_PHASE_ACTIVE && g.lease.held &&
        gate_level() != GATE_OPEN) {
        g.hold_for_verify = true;
        shim_log(LOG_INFO, "%s: ACTIVE; the gate opens once the coordinator releases",
                 op_name(op));
        return false;
    }
    return true;
}

/* Run one phase op; g.lock is not held while the op works (copies block,
 * RESTORE_UNICAST calls peers). A refused or retryable op leaves the shim
 * in the phase it started from. `text`: the request's (LOAD_ALLOCATIONS:
 * the GPU mapping). */
static void run_phase_op(uint16_t op, const char *text, size_t text_len, struct reply *r)
{
    const struct phase_op *d = &phase_ops[op];
    phase_work_fn *work = phase_work((enum cuip_op)op);
    uint64_t t0 = shim_now_ns();
    enum phase_result rc;
    uint16_t from = 0;
    bool reopen;

    if (!work || !d->next) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "%s is not a phase op", op_name(op));
        return;
    }
    pthread_mutex_lock(&g.lock);
    if (!phase_op_begin(op, d, t0, &from, r)) {
        pthread_mutex_unlock(&g.lock);
        return;
    }
    pthread_mutex_unlock(&g.lock);

    rc = op == CUIP_OP_PREPARE_MULTICAST ? drain_contexts(r) : PHASE_DONE;
    /* LOAD's GPUs checked before it re-creates anything (devices.c); in
     * flight already, as the driver's answers may wait on a natively locked
     * process. */
    if (op == CUIP_OP_LOAD_ALLOCATIONS && devices_check_map(text, text_len, r) != 0)
        rc = PHASE_REFUSED;
    if (rc == PHASE_DONE)
        rc = work(r);
    /* The GPUs as a capture found them: once quiet, the application can no
     * longer change them, and SAVE tears down what they are read from. */
    if (op == CUIP_OP_QUIESCE && rc == PHASE_DONE)
        devices_remember();

    pthread_mutex_lock(&g.lock);
    phase_op_settle(op, d, t0, from, rc, r);
    reopen = phase_op_reopens(op, from, rc);
    pthread_mutex_unlock(&g.lock);
    if (reopen && gate_level() != GATE_OPEN) {
        gate_open();
        shim_log(LOG_INFO, "%s: gate open", op_name(op));
    }
}

/* STATUS: what is in flight, never waiting for it (g.lock is only held by
 * a phase op around its bookkeeping, never across its work). */
static void serve_status(struct reply *r, bool ask_driver)
{
    const char *driver = ask_driver ? shim_driver_path() : NULL;

    pthread_mutex_lock(&g.lock);
    if (g.busy) {
        cuip_set_status_in_flight(&r->h, g.op_in_flight,
                                  __atomic_load_n(&g.phase_bytes_done, __ATOMIC_RELAXED),
                                  __atomic_load_n(&g.phase_bytes_total, __ATOMIC_RELAXED),
                                  shim_now_ns() - g.op_started_ns);
    }
    if (driver) {
        reply_msg(r, CUIP_STATUS_OK, "%s", driver);
    } else if (g.phase == CUIP_PHASE_FAILED) {
        reply_msg(r, CUIP_STATUS_OK, "%s", g.reason);
    } else if (gate_held() > 0) {
        char held[256];
        gate_describe(held, sizeof held);
        reply_msg(r, CUIP_STATUS_OK, "%s", held);
    }
    pthread_mutex_unlock(&g.lock);
    if (!driver) {
        uint64_t bytes, count, overhead;
        keep_status(&bytes, &count, &overhead);
        if ((keep_enabled() || count) && keep_record(r, 0, 0, CUIP_HASH_NOT_SAVED) != 0)
            shim_log(LOG_WARN, "STATUS: out of memory for the kept host copy's record");
    }
}

/* HOST_COPY: only in ACTIVE with no op in flight (a copy given back between
 * SAVE and LOAD would take the staged bytes along). */
static void serve_host_copy(bool keep, struct reply *r)
{
    bool ok;

    pthread_mutex_lock(&g.lock);
    ok = g.phase == CUIP_PHASE_ACTIVE && !g.busy;
    if (g.phase != CUIP_PHASE_ACTIVE)
        reply_msg(r, CUIP_STATUS_WRONG_PHASE, "HOST_COPY needs phase ACTIVE; the shim is in "
                  "phase %u", g.phase);
    else if (g.busy)
        reply_msg(r, CUIP_STATUS_REFUSED, "another phase op is running");
    if (ok)
        g.busy = true; /* no phase op starts while the copies are pinned or freed */
    pthread_mutex_unlock(&g.lock);
    if (!ok)
        return;
    keep_request(keep);
    pthread_mutex_lock(&g.lock);
    g.busy = false;
    pthread_mutex_unlock(&g.lock);
    if (keep_record(r, 0, 0, CUIP_HASH_NOT_SAVED) != 0)
        reply_msg(r, CUIP_STATUS_INTERNAL, "HOST_COPY: out of memory for the reply's record");
}

/* ------------------------------------------------------------ the lease */
static void lease_drop(void)
{
    if (g.lease.pidfd >= 0)
        close(g.lease.pidfd);
    memset(&g.lease, 0, sizeof g.lease);
    g.lease.pidfd = -1;
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77 /* Linux 6.5 */
#endif

/* A pidfd of the process at the other end of connection `s`: the holder's pid
 * in this pid namespace when it has one here, else (a coordinator outside the
 * pod: SO_PEERCRED says pid 0) the kernel's own of the peer, so that a holder
 * killed outside the pod frees the lease at once too. -1 where neither works
 * (then the holder's silence ends its lease). */
static int peer_pidfd(int s, pid_t pid)
{
    int fd = -1;
    socklen_t len = sizeof fd;

#ifdef SYS_pidfd_open
    /* A pidfd outlives a recycled pid: kill(pid, 0) could see a newcomer. */
    if (pid > 0)
        return (int)syscall(SYS_pidfd_open, pid, 0);
#endif
    if (s < 0 || getsockopt(s, SOL_SOCKET, SO_PEERPIDFD, &fd, &len) != 0 || len != sizeof fd)
        return -1;
    return fd;
}

static void lease_take(const uint8_t token[CUIP_AUTH_LEN], pid_t pid, int s, uint64_t now)
{
    lease_drop();
    g.lease.held = true;
    memcpy(g.lease.token, token, CUIP_AUTH_LEN);
    g.lease.pid = pid;
    g.lease.pidfd = peer_pidfd(s, pid);
    g.lease.since_s = (int64_t)time(NULL);
    g.lease.taken_ns = now;
    g.lease.last_ns = now;
}

/* Under g.lock: whether another coordinator's HANDSHAKE takes over a lease
 * whose holder never acted, once SNAPSHOT_LEASE_HANDSHAKE_S has passed since
 * it was taken. */
static bool lease_unused(const struct shim_lease *l, uint64_t now)
{
    uint64_t window = ms_to_ns((uint64_t)shim_settings()->lease_handshake_ms);

    return l->held && !l->acting && now - l->taken_ns >= window;
}

/* Under g.lock. In PREPARED, a holder that sent nothing for
 * SNAPSHOT_LEASE_IDLE_S has let its lease lapse, alive or not: a process that
 * took the free lease of a PREPARED group with one HANDSHAKE does not keep it
 * for as long as it lives (a restore's run sends something at every phase,
 * and no op of this shim runs then). */
static bool lease_holder_gone(const struct shim_lease *l, uint64_t now)
{
    uint64_t idle = ms_to_ns((uint64_t)shim_settings()->lease_idle_ms);

    if (g.phase == CUIP_PHASE_PREPARED && !g.busy && now - l->last_ns > idle)
        return true;
    if (l->pidfd >= 0) {
        struct pollfd p = {.fd = l->pidfd, .events = POLLIN};
        return poll(&p, 1, 0) == 1; /* readable once the process has exited */
    }
    if (l->pid > 0)
        return kill(l->pid, 0) != 0 && errno == ESRCH;
    return now - l->last_ns > idle; /* not visible here: its silence ends it */
}

/* Under g.lock: the gate is closed and nothing is torn down (QUIESCED, or
 * ACTIVE between the rounds of a QUIESCE), with no phase op running. */
static bool gated_untouched(void)
{
    return !g.busy && (g.phase == CUIP_PHASE_QUIESCED ||
                       (g.phase == CUIP_PHASE_ACTIVE && gate_level() != GATE_OPEN));
}

/* Gated without a coordinator: nothing is torn down, so the process goes
 * back to ACTIVE and its gate opens (lock order: g.lock, then the gate's
 * own). */
static void unquiesce(void)
{
    pthread_mutex_lock(&g.lock);
    if (gated_untouched()) {
        g.phase = CUIP_PHASE_ACTIVE;
        g.hold_for_verify = false;
        gate_open();
        shim_log(LOG_INFO, "gated without a coordinator: ACTIVE, gate open");
    }
    pthread_mutex_unlock(&g.lock);
}

/* Run by a thread held at the gate: a gated process has nothing torn down,
 * so when its coordinator is gone (the lease holder exited) it goes back to
 * ACTIVE and runs on instead of waiting for a recover; so it does when
 * QUIESCE rounds outlast the shim's own deadline (a coordinator that
 * stopped sending them). */
static void gate_watch(void)
{
    uint64_t now = shim_now_ns();
    bool gone, overdue;
    pid_t holder;

    pthread_mutex_lock(&g.lock);
    if (gated_untouched()) {
        gone = !g.lease.held || lease_holder_gone(&g.lease, now);
        /* Between QUIESCE rounds: the shim's own deadline. Held for a
         * verification: the holder's silence for SNAPSHOT_LEASE_IDLE_S. */
        if (g.hold_for_verify)
            overdue = now - g.lease.last_ns >
                      ms_to_ns((uint64_t)shim_settings()->lease_idle_ms);
        else
            overdue = g.phase == CUIP_PHASE_ACTIVE &&
                      now - g.quiesce_started_ns >
                          ms_to_ns((uint64_t)shim_settings()->quiesce_timeout_ms);
        if (gone || overdue) {
            holder = g.lease.held ? g.lease.pid : 0;
            if (gone)
                lease_drop();
            g.phase = CUIP_PHASE_ACTIVE;
            gate_open();
            shim_log(LOG_WARN, "gated, and %s (pid %d; 0: none): ACTIVE, gate open",
                     gone ? "its coordinator is gone"
                     : g.hold_for_verify ? "its coordinator sent nothing after the restore"
                                         : "no QUIESCE round came within the shim's own deadline",
                     (int)holder);
            g.hold_for_verify = false;
        }
    }
    pthread_mutex_unlock(&g.lock);
}

static void lease_refuse(struct reply *r, unsigned op, const char *why)
{
    char when[32] = "?";
    time_t t = (time_t)g.lease.since_s;
    struct tm tm;
    char who[48];
    char unused[160];

    if (gmtime_r(&t, &tm))
        strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    if (g.lease.pid > 0)
        snprintf(who, sizeof who, "pid %d", (int)g.lease.pid);
    else
        snprintf(who, sizeof who, "a process outside this pid namespace");
    if (g.lease.acting)
        unused[0] = 0;
    else
        snprintf(unused, sizeof unused, "; it has sent nothing past HANDSHAKE: another's "
                 "HANDSHAKE takes the lease once SNAPSHOT_LEASE_HANDSHAKE_S (%.3g s) has "
                 "passed since", (double)shim_settings()->lease_handshake_ms / 1000.0);
    reply_msg(r, CUIP_STATUS_REFUSED,
              "%s refused: %s; another coordinator holds this process (%s, as this shim "
              "sees it, since %s%s)",
              op_name(op), why, who, when, unused);
}

/* Under g.lock: whether request `q` from process `peer` may go on, by the
 * lease rules; RELEASE is answered here. False: `r` says why. */
static bool lease_admit(const struct cuip_header *q, pid_t peer, int s, struct reply *r)
{
    bool token = !shim_is_zero(q->authorization, CUIP_AUTH_LEN);
    uint64_t now = shim_now_ns();
    bool mine;

    if (g.lease.held && lease_holder_gone(&g.lease, now)) {
        shim_log(LOG_WARN, "coordinator lease of pid %d is free: its holder is gone or "
                 "sent nothing for SNAPSHOT_LEASE_IDLE_S", (int)g.lease.pid);
        lease_drop();
    }
    mine = g.lease.held && token && shim_ct_equal(g.lease.token, q->authorization, CUIP_AUTH_LEN);
    if (!mine && token && q->op == CUIP_OP_HANDSHAKE && lease_unused(&g.lease, now)) {
        shim_log(LOG_WARN, "coordinator lease of pid %d taken over: it sent nothing past "
                 "HANDSHAKE and INSPECT for SNAPSHOT_LEASE_HANDSHAKE_S", (int)g.lease.pid);
        lease_drop();
    }
    if (mine) {
        g.lease.last_ns = now;
        if (q->op != CUIP_OP_HANDSHAKE && q->op != CUIP_OP_INSPECT && q->op != CUIP_OP_RELEASE)
            g.lease.acting = true;
    }
    if (q->op == CUIP_OP_RELEASE) {
        if (!token) {
            reply_msg(r, CUIP_STATUS_BAD_REQUEST, "RELEASE needs the lease token");
            return false;
        }
        if (g.lease.held && !mine) {
            lease_refuse(r, q->op, "the token is not the holder's");
            return false;
        }
        lease_drop(); /* not held: released already (or lapsed) */
        r->h.status = CUIP_STATUS_OK;
        return false;
    }
    if (!token) {
        /* Outside any lease: what reads nothing but state, or anything while
         * nobody holds the lease (tools and tests speaking the protocol). */
        if (!g.lease.held || q->op == CUIP_OP_HANDSHAKE || q->op == CUIP_OP_INSPECT)
            return true;
        lease_refuse(r, q->op, "the request carries no lease token");
        return false;
    }
    if (mine)
        return true;
    if (g.lease.held) {
        lease_refuse(r, q->op, "the lease token is not the holder's");
        return false;
    }
    if (q->op != CUIP_OP_HANDSHAKE) {
        reply_msg(r, CUIP_STATUS_REFUSED, "%s refused: the coordinator lease is not held "
                  "(lapsed or released); HANDSHAKE takes it", op_name(q->op));
        return false;
    }
    lease_take(q->authorization, peer, s, now);
    shim_log(LOG_INFO, "coordinator lease taken by pid %d", (int)peer);
    return true;
}

static void handle(const struct cuip_header *q, const char *text,
                   const struct request_fds *fds, pid_t peer, int s, struct reply *r)
{
    bool admitted;

    if (!validate(q, r))
        return;
    if (q->op == CUIP_OP_EXPORT) {
        if (!shim_is_participant(text)) {
            reply_msg(r, CUIP_STATUS_BAD_REQUEST, "EXPORT must carry the requesting "
                      "participant's id (32 lowercase hex digits)");
            return;
        }
        cap_serve_export(q, text, peer, r); /* peers: authorized by the capability */
        return;
    }
    if (q->op == CUIP_OP_STATUS) {
        /* read-only: served to anyone trusted, lease or not */
        if (cuip_status_ask(q) & CUIP_ASK_DEVICES)
            devices_report(r, cuip_status_ask(q) & CUIP_ASK_DRIVER);
        else
            serve_status(r, cuip_status_ask(q) == CUIP_ASK_DRIVER);
        return;
    }
    pthread_mutex_lock(&g.lock);
    admitted = lease_admit(q, peer, s, r);
    pthread_mutex_unlock(&g.lock);
    if (q->op == CUIP_OP_RELEASE && r->h.status == CUIP_STATUS_OK)
        unquiesce(); /* a run that stopped at QUIESCE needs no rollback */
    if (!admitted)
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
        /* QUIESCED: a capture reads the records once the gate keeps the
         * application from changing them. PREPARED: a restore compares them
         * with its state file before it changes anything. */
        if (!cuip_op_served_in(CUIP_OP_INSPECT, g.phase))
            reply_msg(r, CUIP_STATUS_WRONG_PHASE, "INSPECT needs phase ACTIVE, QUIESCED or "
                      "PREPARED; the shim is in phase %u", g.phase);
        else if (g.busy)
            reply_msg(r, CUIP_STATUS_REFUSED, "another phase op is running");
        else if (unicast_inspect(r) == 0 && cap_inspect_fetches(r) == 0)
            unowned_inspect(r);
        pthread_mutex_unlock(&g.lock);
        return;
    case CUIP_OP_STORE_STAGED:
    case CUIP_OP_FETCH_STAGED:
        stored_serve(q, fds, r);
        return;
    case CUIP_OP_HOST_COPY:
        serve_host_copy(cuip_host_copy_request(q) == CUIP_HOST_COPY_KEEP, r);
        return;
    default:
        if (q->op == CUIP_OP_QUIESCE) {
            pthread_mutex_lock(&g.lock);
            g.quiesce_deadline_ns = cuip_quiesce_deadline_ns(q);
            g.quiesce_round = cuip_quiesce_round(q) == 1;
            pthread_mutex_unlock(&g.lock);
        }
        run_phase_op(q->op, text, q->message_length, r);
        return;
    }
}

/* ------------------------------------------------------------ connections */
static void close_fds(struct request_fds *fds)
{
    for (unsigned i = 0; i < fds->n; i++)
        close(fds->fd[i]);
    fds->n = 0;
}

static void *conn_main(void *arg)
{
    int s = (int)(intptr_t)arg;
    struct ucred cr;
    socklen_t cl = sizeof cr;
    struct cuip_header q;
    char text[CUIP_MESSAGE_MAX];
    struct reply *r = NULL;
    struct request_fds fds = {.n = 0}; /* STORE_STAGED / FETCH_STAGED: the files */
    long timeout_ms = shim_settings()->io_timeout_ms;
    uint64_t deadline = shim_now_ns() + ms_to_ns((uint64_t)timeout_ms);

    /* Apart: when getsockopt fails, `cr` holds nothing to name. */
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0) {
        shim_log(LOG_WARN, "control connection refused: SO_PEERCRED: %s", strerror(errno));
        goto out;
    }
    if (!shim_trusted_uid(cr.uid)) {
        shim_log(LOG_WARN, "control connection from uid %d refused", (int)cr.uid);
        goto out;
    }
    if (io_read_fds(s, &q, sizeof q, deadline, fds.fd, CUIP_STORED_MAX_PARTS, &fds.n,
                    &fds.too_many) != 0)
        goto out; /* truncated, stalled or hung up: drop it */
    if (q.op != CUIP_OP_STORE_STAGED && q.op != CUIP_OP_FETCH_STAGED)
        close_fds(&fds); /* no other op takes one */
    else if (fds.too_many)
        close_fds(&fds); /* refused: none is used */
    memset(text, 0, sizeof text);
    /* Only EXPORT (the fetcher's id) and LOAD_ALLOCATIONS (the GPU mapping)
     * carry text; validate() refuses any other length, so nothing more is
     * read for a request it will refuse. */
    if (((q.op == CUIP_OP_EXPORT && q.message_length == CUIP_PARTICIPANT_LEN) ||
         (q.op == CUIP_OP_LOAD_ALLOCATIONS && q.message_length <= sizeof text)) &&
        q.message_length && io_read_all(s, text, q.message_length, deadline, NULL) != 0)
        goto out;
    r = malloc(sizeof *r);
    if (!r)
        goto out;
    reply_init(r, q.op);
    handle(&q, text, &fds, cr.pid, s, r);
    pthread_mutex_lock(&g.lock);
    r->h.phase = g.phase;
    pthread_mutex_unlock(&g.lock);
    if (r->h.status != CUIP_STATUS_OK)
        shim_log(LOG_DEBUG, "%s answered status %d: %.*s", op_name(q.op), r->h.status,
                 (int)r->h.message_length, r->msg);
    deadline = shim_now_ns() + ms_to_ns((uint64_t)timeout_ms);
    if (reply_send(s, r, deadline) != 0)
        shim_log(LOG_DEBUG, "reply to %s not delivered: %s", op_name(q.op), strerror(errno));
out:
    close_fds(&fds);
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

static int (*endpoint_heal)(int fd);

void control_set_heal(int (*heal)(int fd))
{
    endpoint_heal = heal;
}

/* A descriptor kept in reserve by the listener thread: out of descriptors,
 * it is given up for one accept, so that the coordinator hears why at once
 * instead of waiting for a reply that cannot come. */
static int reserve_fd = -1;
static struct reply out_of_fds; /* the listener thread's own */

static void answer_out_of_fds(int lfd, int err)
{
    struct cuip_header q;
    struct ucred cr;
    socklen_t cl = sizeof cr;
    uint64_t deadline;
    int s;

    if (reserve_fd < 0) {
        usleep(10000); /* nothing to give up: the queued request waits */
        return;
    }
    close(reserve_fd);
    reserve_fd = -1;
    s = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (s >= 0) {
        deadline = shim_now_ns() + 1000000000ull; /* the listener waits at most this */
        if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &cl) == 0 && shim_trusted_uid(cr.uid) &&
            io_read_all(s, &q, sizeof q, deadline, NULL) == 0) {
            reply_init(&out_of_fds, q.op);
            reply_msg(&out_of_fds, CUIP_STATUS_REFUSED,
                      "%s refused: this process is out of file descriptors (%s); nothing "
                      "was done", op_name(q.op),
                      err == EMFILE ? "EMFILE: its RLIMIT_NOFILE is reached"
                                    : "ENFILE: the system's file table is full");
            pthread_mutex_lock(&g.lock);
            out_of_fds.h.phase = g.phase;
            pthread_mutex_unlock(&g.lock);
            reply_send(s, &out_of_fds, deadline);
        }
        close(s);
    }
    shim_log(LOG_ERROR, "out of file descriptors (%s): a control request was refused",
             strerror(err));
    reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

/* One connection to its own thread; false when the listener must stop. */
static bool accept_one(int lfd)
{
    pthread_t t;
    pthread_attr_t at;
    int s = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);

    if (s < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
            return true;
        if (errno == EMFILE || errno == ENFILE) {
            answer_out_of_fds(lfd, errno);
            return true;
        }
        if (errno == ENOMEM || errno == ENOBUFS) {
            usleep(10000);
            return true;
        }
        shim_log(LOG_ERROR, "accept failed: %s; control server stops", strerror(errno));
        return false;
    }
    if (__atomic_add_fetch(&connections, 1, __ATOMIC_RELAXED) > MAX_CONNECTIONS) {
        close(s); /* a flood: drop, the coordinator retries or fails */
        __atomic_sub_fetch(&connections, 1, __ATOMIC_RELAXED);
        return true;
    }
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, conn_main, (void *)(intptr_t)s) != 0) {
        close(s);
        __atomic_sub_fetch(&connections, 1, __ATOMIC_RELAXED);
    }
    pthread_attr_destroy(&at);
    return true;
}

/* A replaced listener: what was queued on it before it lost its path is
 * served, then it is closed. */
static void retire(int old)
{
    struct pollfd p = {.fd = old, .events = POLLIN};

    while (poll(&p, 1, 0) == 1 && (p.revents & POLLIN) && accept_one(old))
        p.revents = 0;
    close(old);
}

void *control_listen(void *arg)
{
    int lfd = (int)(intptr_t)arg;
    uint64_t period = ms_to_ns((uint64_t)CONTROL_HEAL_MS);
    uint64_t next = shim_now_ns() + period;

    gate_set_watch(gate_watch);
    if (reserve_fd < 0)
        reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    for (;;) {
        struct pollfd p = {.fd = lfd, .events = POLLIN};
        int n = poll(&p, 1, CONTROL_HEAL_MS);
        uint64_t now = shim_now_ns();

        /* Checked on the poll's timeout and between connections alike: a
         * busy listener heals as soon as an idle one. */
        if (endpoint_heal && now >= next) {
            int fd = endpoint_heal(lfd);
            next = now + period;
            if (fd != lfd) {
                retire(lfd);
                lfd = fd;
                continue;
            }
        }
        if (n == 1 && !accept_one(lfd))
            return NULL;
    }
    return NULL;
}

void control_after_fork(void)
{
    connections = 0;
    if (reserve_fd >= 0)
        close(reserve_fd); /* the parent's listener's; the child's opens its own */
    reserve_fd = -1;
}
